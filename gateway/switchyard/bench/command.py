"""What `switchyard bench` does: build the profile's phases, run them, report.

The click command in `switchyard.cli` only gathers options into
`BenchOptions` and calls `run`.
"""

from __future__ import annotations

import asyncio
import random
import shlex
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import httpx
import msgspec

from switchyard import __version__
from switchyard.bench import prompts
from switchyard.bench.client import Api, Endpoint, RequestSpec
from switchyard.bench.plots import write_plots
from switchyard.bench.profile import (Phase, Profile, auto_rates, rate_phases, resolve_profile,
                                      throughput_phase, warmup_phase, worst_case_seconds)
from switchyard.bench.progress import PhaseProgress
from switchyard.bench.report import BenchReport, markdown_table, write_json, write_markdown
from switchyard.bench.runner import run_closed_loop, run_open_loop
from switchyard.bench.stats import PhaseSummary, summarize


class BenchError(Exception):
    """A run that cannot go on (server unreachable, every warmup request failed, ...)."""


class BenchOptions(msgspec.Struct, kw_only=True):
    """The command line, resolved."""

    url: str
    api: Api
    profile: Profile
    model: str | None = None
    tokenizer: str | None = None
    """A local tokenizer (folder or tokenizer.json), `server`, `words`; None: server, else words."""
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int = 0
    out_dir: str | None = None
    progress: bool = True
    command_line: str = ""


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def server_root(url: str) -> str:
    """`http://host:port` from what users paste: trailing `/` or `/v1` removed."""
    url = url.rstrip("/")
    return url.removesuffix("/v1") if url.endswith("/v1") else url


async def _model_name(client: httpx.AsyncClient, url: str) -> str | None:
    """The served model: `/v1/models`' first id, else TGI's `/info` model_id."""
    for path, pick in (("/v1/models", lambda j: j["data"][0]["id"]),
                       ("/info", lambda j: j["model_id"])):
        try:
            reply = await client.get(url + path, timeout=10)
            if reply.status_code == 200:
                return str(pick(reply.json()))
        except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError):
            continue
    return None


async def _prompt_builder(client: httpx.AsyncClient, opts: BenchOptions) -> prompts.PromptBuilder:
    words = prompts.corpus_words(opts.profile.input_tokens.high)
    if opts.tokenizer not in (None, "server", "words"):
        return prompts.local_builder(opts.tokenizer, words, opts.seed)
    if opts.tokenizer != "words":
        try:
            built = await prompts.server_builder(client, opts.url, words, opts.seed)
        except httpx.TransportError as exc:
            raise BenchError(f"cannot reach {opts.url}: {type(exc).__name__}: {exc}") from None
        if built is not None:
            return built
        if opts.tokenizer == "server":
            raise BenchError(f"{opts.url}/tokenize did not answer; pass --tokenizer PATH")
        _say("note: the server has no /tokenize; prompt lengths are estimated in words "
             "(pass --tokenizer PATH for exact token counts)")
    return prompts.words_builder(words, opts.seed)


def _request_factory(builder: prompts.PromptBuilder, opts: BenchOptions,
                     rng: random.Random) -> Callable[[], RequestSpec]:
    profile = opts.profile

    def make() -> RequestSpec:
        prompt = builder.build(profile.input_tokens.sample(rng), rng)
        return RequestSpec(prompt=prompt.text, prompt_tokens=prompt.tokens,
                           max_tokens=profile.output_tokens.sample(rng),
                           temperature=opts.temperature, ignore_eos=opts.ignore_eos)

    return make


async def _run_phase(phase: Phase, index: int, client: httpx.AsyncClient, endpoint: Endpoint,
                     builder: prompts.PromptBuilder, opts: BenchOptions) -> PhaseSummary:
    # Each phase has its own seeded stream, so adding a phase does not shift the others.
    rng = random.Random(opts.seed * 1_000_003 + index)
    make = _request_factory(builder, opts, rng)
    p = opts.profile
    async with PhaseProgress(phase, opts.progress) as bar:
        if phase.rate is None:
            run = await run_closed_loop(phase, client, endpoint, make,
                                        timeout_s=p.request_timeout_s, on_done=bar.done)
        else:
            run = await run_open_loop(phase, client, endpoint, make, arrival=p.arrival, rng=rng,
                                      timeout_s=p.request_timeout_s,
                                      on_done=bar.done)
    return summarize(phase, run.results, run.elapsed_s)


async def _run_all(opts: BenchOptions) -> BenchReport:
    profile = opts.profile
    started = datetime.now(UTC).isoformat(timespec="seconds")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(profile.request_timeout_s, connect=10.0)
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else None
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        model = opts.model or await _model_name(client, opts.url)
        builder = await _prompt_builder(client, opts)
        if profile.input_tokens.high > builder.capacity:
            raise BenchError(f"prompts of {profile.input_tokens.high} tokens do not fit the corpus")
        endpoint = Endpoint(url=opts.url, api=opts.api,
                            model=model if opts.api != "tgi" else None)
        _say(f"bench {opts.url} api={opts.api} model={model or '-'} profile={profile.name} "
             f"tokens: prompts {profile.input_tokens.describe()} (counted by {builder.source}), "
             f"outputs {profile.output_tokens.describe()}; "
             f"stops within {worst_case_seconds(profile):.0f}s")
        phases: list[PhaseSummary] = []
        if profile.warmup_requests > 0:
            warm = await _run_phase(warmup_phase(profile), 0, client, endpoint, builder, opts)
            if warm.successful == 0:
                raise BenchError("every warmup request failed: "
                                 + "; ".join(warm.error_samples or ["no answer"]))
            phases.append(warm)
        if profile.throughput:
            peak = throughput_phase(profile)
            phases.append(await _run_phase(peak, 1, client, endpoint, builder, opts))
        rates = profile.rates
        if rates is None:
            # An automatic sweep is scaled to the measured peak: without one there is none.
            rates = (auto_rates(phases[-1].qps, profile.rate_steps, profile.rate_factor)
                     if profile.throughput else ())
        for i, phase in enumerate(rate_phases(rates, profile), start=2):
            phases.append(await _run_phase(phase, i, client, endpoint, builder, opts))
    return BenchReport(version=__version__, started_at=started, url=opts.url, api=opts.api,
                       model=model, tokenizer=builder.source, ignore_eos=opts.ignore_eos,
                       temperature=opts.temperature, seed=opts.seed, profile=profile,
                       phases=phases)


def run(opts: BenchOptions) -> BenchReport:
    """Run the benchmark, print the table, and write the files when `out_dir` is set."""
    opts = msgspec.structs.replace(opts, url=server_root(opts.url))
    report = asyncio.run(_run_all(opts))
    print(markdown_table(report.phases), flush=True)
    if opts.out_dir is not None:
        out = Path(opts.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        report.plots = write_plots(report, out)
        write_json(report, out / "bench.json")
        write_markdown(report, out / "bench.md", opts.command_line)
        _say(f"wrote {out / 'bench.json'}, {out / 'bench.md'} and "
             + ", ".join(str(out / name) for name in report.plots))
    return report


def bench_from_cli(options: dict[str, object]) -> None:
    """The `switchyard bench` command: options as click parsed them."""
    import click

    o = options
    try:
        profile = resolve_profile(
            str(o["profile"]), input_tokens=o["input_tokens"], output_tokens=o["output_tokens"],
            rates=o["rates"], rate_steps=o["rate_steps"], duration_s=o["duration"],
            max_requests=o["max_requests"], concurrency=o["concurrency"],
            warmup_requests=o["warmup"], arrival=o["arrival"],
            request_timeout_s=o["request_timeout"],
            throughput=False if o["no_throughput"] else None)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if not profile.throughput and profile.rates is None:
        raise click.BadParameter("--no-throughput needs --rates (a sweep is scaled to the peak)")
    opts = BenchOptions(
        url=str(o["url"]), api=o["api"], profile=profile,  # type: ignore[arg-type]
        model=o["model"], api_key=o["api_key"], tokenizer=o["tokenizer"],  # type: ignore[arg-type]
        ignore_eos=bool(o["ignore_eos"]), temperature=float(o["temperature"]),  # type: ignore[arg-type]
        seed=int(o["seed"]), out_dir=o["out_dir"],  # type: ignore[arg-type]
        progress=not o["no_progress"], command_line=shlex.join(["switchyard", *sys.argv[1:]]))
    if opts.ignore_eos and opts.api == "tgi":
        _say("note: TGI's API has no per-request ignore_eos; start the server with "
             "TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN=true")
    try:
        run(opts)
    except BenchError as exc:
        raise click.ClickException(str(exc)) from None
