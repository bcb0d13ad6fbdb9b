"""`switchyard serve` and `switchyard plugins`.

Flags keep TGI's launcher names (and their environment variables), so a TGI
command line works here unchanged.
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING

import click

from switchyard import __version__
from switchyard.settings import ServeSettings

if TYPE_CHECKING:
    from switchyard_spec import CommandSpec


def _key_values(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, str]:
    pairs = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}")
        pairs[key.strip()] = value.strip()
    return pairs


def _generation_defaults(ctx: click.Context, param: click.Parameter, value: str | None):
    from switchyard.planning.defaults import GenerationDefaults, parse_defaults

    if not value:
        return GenerationDefaults()
    try:
        return parse_defaults(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _lora_adapters(ctx: click.Context, param: click.Parameter, value: str) -> dict[str, str]:
    from switchyard.models.lora import parse_lora_adapters

    try:
        return parse_lora_adapters(value or "")
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


class _WithPluginCommands(click.Group):
    """The built-in commands, then those plugins declare (`switchyard_commands`).

    Plugins are only looked up for a name that is not built in, or for
    `--help`, so `switchyard serve` pays nothing for them.
    """

    def _plugin_commands(self) -> dict[str, CommandSpec]:
        from switchyard.plugins import PluginHost

        return PluginHost.from_entry_points().commands()

    def list_commands(self, ctx: click.Context) -> list[str]:
        builtin = super().list_commands(ctx)
        return builtin + sorted(set(self._plugin_commands()) - set(builtin))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            return command
        spec = self._plugin_commands().get(cmd_name)
        if spec is None:
            return None

        @click.command(name=cmd_name, help=spec.help,
                       context_settings={"ignore_unknown_options": True,
                                         "help_option_names": []})
        @click.argument("args", nargs=-1, type=click.UNPROCESSED)
        def run(args: tuple[str, ...]) -> None:
            raise SystemExit(spec.main(list(args)))

        return run


@click.group(cls=_WithPluginCommands)
@click.version_option(__version__, prog_name="switchyard")
def main() -> None:
    """Switchyard: serve LLMs over the OpenAI and TGI APIs."""


@main.command()
@click.option("--config", envvar="SWITCHYARD_CONFIG", default=None,
              type=click.Path(dir_okay=False),
              help="TOML file of models to serve ([[models]] tables; see docs/routing.md).")
@click.option("--model-id", envvar="MODEL_ID", default=None,
              help="Local model folder, .gguf file, or hub id (from the local cache). Default: "
                   "switchyard/smollm2-135m-instruct, prepared once into the model cache.")
@click.option("--served-model-name", envvar="SERVED_MODEL_NAME", default=None,
              help="Name clients send as `model`; defaults to the model id.")
@click.option("--revision", envvar="REVISION", default=None)
@click.option("--gguf-file", envvar="SWITCHYARD_GGUF_FILE", default=None, metavar="NAME",
              help="The .gguf file to serve in the --model-id folder, when it holds several.")
@click.option("--engine", envvar="SWITCHYARD_ENGINE", default=None,
              help="Engine to use (see `switchyard plugins`); default: the best available.")
@click.option("--hostname", envvar="HOSTNAME", default="0.0.0.0", show_default=True)
@click.option("-p", "--port", envvar="PORT", type=int, default=8080, show_default=True)
@click.option("--dtype", envvar="DTYPE", default="auto", show_default=True,
              type=click.Choice(["auto", "float32", "bfloat16", "float16"]))
@click.option("--quantize", envvar="QUANTIZE", default=None,
              help="A quantization method (see `switchyard plugins`), e.g. int8 or int4.")
@click.option("--max-input-tokens", "--max-input-length",
              envvar=["MAX_INPUT_TOKENS", "MAX_INPUT_LENGTH"], type=int,
              default=0, help="Default: max-total-tokens - 1.")
@click.option("--max-total-tokens", envvar="MAX_TOTAL_TOKENS", type=int, default=0,
              help="Default: the engine's (xeon: the model's context where the KV cache "
              "holds one sequence of it; gaudi: the model's context up to 4096).")
@click.option("--sharded", envvar="SHARDED", type=click.BOOL, default=None,
              help="true: split the model over devices with tensor parallelism (TGI's flag).")
@click.option("--num-shard", envvar="NUM_SHARD", type=click.IntRange(min=1), default=None,
              help="Devices to split the model over; implies --sharded true.")
@click.option("--max-concurrent-requests", envvar="MAX_CONCURRENT_REQUESTS", type=int,
              default=128, show_default=True)
@click.option("--max-best-of", envvar="MAX_BEST_OF", type=int, default=2, show_default=True)
@click.option("--max-stop-sequences", envvar="MAX_STOP_SEQUENCES", type=int, default=4,
              show_default=True)
@click.option("--max-top-n-tokens", envvar="MAX_TOP_N_TOKENS", type=int, default=5,
              show_default=True)
@click.option("--max-client-batch-size", envvar="MAX_CLIENT_BATCH_SIZE", type=int, default=4,
              show_default=True)
@click.option("--max-batch-size", envvar="MAX_BATCH_SIZE", type=int, default=0)
@click.option("--max-batch-prefill-tokens", envvar="MAX_BATCH_PREFILL_TOKENS", type=int, default=0)
@click.option("--max-batch-total-tokens", envvar="MAX_BATCH_TOTAL_TOKENS", type=int, default=0)
@click.option("--max-waiting-tokens", envvar="MAX_WAITING_TOKENS", type=int, default=20,
              show_default=True)
@click.option("--waiting-served-ratio", envvar="WAITING_SERVED_RATIO", type=float, default=0.3,
              show_default=True)
@click.option("--engine-option", "engine_options", multiple=True, callback=_key_values,
              metavar="KEY=VALUE",
              help="Engine-specific setting, repeatable (xeon: num_threads, block_size, "
                   "prefix_caching).")
@click.option("--speculate", envvar="SPECULATE", type=click.IntRange(min=0), default=None,
              help="Draft up to N tokens a step from each sequence's own text (n-gram "
                   "speculative decoding; the same output, faster on text that repeats its "
                   "input). The engine option speculate=N; see docs/xeon.md.")
@click.option("--speculative-model", envvar="SPECULATIVE_MODEL", default=None, metavar="PATH",
              help="Draft with this smaller model (same tokenizer) instead of n-grams; needs "
                   "--speculate N. The engine option speculative_model=PATH; see docs/xeon.md.")
@click.option("--lora-adapters", envvar="LORA_ADAPTERS", default="", callback=_lora_adapters,
              metavar="NAME=PATH,...",
              help="LoRA adapters to serve on the model, comma-separated: NAME=FOLDER, a hub id "
                   "or ID@REVISION from the local cache (TGI's flag); see docs/lora.md.")
@click.option("--max-loras", envvar="MAX_LORAS", type=click.IntRange(min=0), default=0,
              help="Adapters held in memory at once (least recently used out); 0: 8.")
@click.option("--max-lora-rank", envvar="MAX_LORA_RANK", type=click.IntRange(min=0),
              default=0, help="The largest adapter rank accepted; 0: 64.")
@click.option("--allow-runtime-lora-updating", "allow_runtime_lora",
              envvar="SWITCHYARD_ALLOW_RUNTIME_LORA_UPDATING", is_flag=True,
              help="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's).")
@click.option("--engine-process", envvar="SWITCHYARD_ENGINE_PROCESS", is_flag=True,
              help="Run each local model's engine in a process of its own (restarted if it "
                   "dies); see docs/routing.md.")
@click.option("--cpus", envvar="SWITCHYARD_CPUS", default=None, metavar="CPULIST",
              help="Pin the engine process to these CPUs, e.g. 0-3,8 (needs --engine-process).")
@click.option("--payload-limit", envvar="PAYLOAD_LIMIT", type=int, default=2_000_000,
              show_default=True)
@click.option("--image-hosts", envvar="SWITCHYARD_IMAGE_HOSTS", default="", metavar="HOSTS",
              help="Hosts images in prompts may be fetched from over http(s), comma-separated: "
                   "names, *.domain, IP addresses, or * for any public host. Default: none "
                   "(data: URLs only). See docs/vision.md.")
@click.option("--image-max-bytes", envvar="SWITCHYARD_IMAGE_MAX_BYTES",
              type=click.IntRange(min=1), default=10_000_000, show_default=True,
              help="The most bytes one image may have, encoded.")
@click.option("--image-max-pixels", envvar="SWITCHYARD_IMAGE_MAX_PIXELS",
              type=click.IntRange(min=1), default=4096 * 4096, show_default=True,
              help="The most pixels (width x height) one image may have.")
@click.option("--image-fetch-timeout", envvar="SWITCHYARD_IMAGE_FETCH_TIMEOUT",
              type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="Seconds one http(s) image fetch may take, redirects included.")
@click.option("--max-images", envvar="SWITCHYARD_MAX_IMAGES", type=click.IntRange(min=0),
              default=8, show_default=True, help="The most images one request may carry.")
@click.option("--responses-store-max-entries", envvar="SWITCHYARD_RESPONSES_STORE_MAX_ENTRIES",
              type=click.IntRange(min=0), default=1000, show_default=True,
              help="Responses (/v1/responses) kept in memory for retrieval and "
                   "previous_response_id, least recently used out first; 0: store nothing.")
@click.option("--responses-store-max-bytes", envvar="SWITCHYARD_RESPONSES_STORE_MAX_BYTES",
              type=click.IntRange(min=1), default=256 * 2**20, show_default=True,
              help="Bytes the kept responses may take in all.")
@click.option("--override-generation-config", "generation_defaults",
              envvar="SWITCHYARD_OVERRIDE_GENERATION_CONFIG", default=None,
              callback=_generation_defaults,
              help="JSON defaults for sampling fields an OpenAI request leaves out, as vLLM's "
                   "flag: temperature, top_p, top_k, min_p, repetition_penalty, frequency_penalty, "
                   "presence_penalty. E.g. '{\"temperature\": 0}' for agent "
                   "clients that send none.")
@click.option("--strict-hosted-tools", envvar="SWITCHYARD_STRICT_HOSTED_TOOLS", is_flag=True,
              help="Refuse (400) Responses requests that offer hosted tools (web_search, "
                   "file_search, ...) instead of leaving them out of the prompt.")
@click.option("--api-key", envvar="API_KEY", default=None,
              help="Require `Authorization: Bearer <key>` on the generation routes.")
@click.option("--log-level", envvar="LOG_LEVEL", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--json-output", envvar="JSON_OUTPUT", is_flag=True,
              help="Log JSON lines (one per finished request, with its timings).")
@click.option("--otlp-endpoint", envvar="OTLP_ENDPOINT", default=None,
              help="Export traces to this OTLP/HTTP collector, e.g. http://127.0.0.1:4318.")
@click.option("--otlp-service-name", envvar="OTLP_SERVICE_NAME", default="switchyard",
              show_default=True, help="service.name of the exported traces.")
@click.option("--drain-timeout", envvar="SWITCHYARD_DRAIN_TIMEOUT", type=click.FloatRange(min=0),
              default=30.0, show_default=True,
              help="On SIGTERM: readiness fails at once and requests in flight get this many "
                   "seconds to finish before the server exits; 0: exit at once.")
@click.option("--disable-telemetry", envvar="SWITCHYARD_DISABLE_TELEMETRY", is_flag=True,
              hidden=True, help="Record no request metrics, traces or request logs "
                                "(to measure what they cost).")
def serve(**options: object) -> None:
    """Load a model, warm it up and serve the OpenAI and TGI APIs."""
    from switchyard.telemetry.logs import configure_logging

    speculate, draft = options.pop("speculate"), options.pop("speculative_model")
    if speculate is not None:  # TGI's flag, as the engine option it is
        options["engine_options"] = {**options["engine_options"],  # type: ignore[dict-item]
                                     "speculate": str(speculate)}
    if draft is not None:  # vLLM's setting, as the engine option it is
        options["engine_options"] = {**options["engine_options"],  # type: ignore[dict-item]
                                     "speculative_model": str(draft)}
    settings = ServeSettings(**options)  # type: ignore[arg-type]
    # First, so that everything after, imports included, logs in one format.
    configure_logging(settings.log_level, settings.json_output)

    from switchyard import drain
    from switchyard.app import create_app

    def stop_on_failure() -> None:
        # A server that cannot load its model should exit, as TGI's launcher does.
        os.kill(os.getpid(), signal.SIGTERM)

    app = create_app(settings, on_startup_failure=stop_on_failure)
    # uvicorn, with SIGTERM draining the requests in flight first (`switchyard.drain`).
    drain.run(app, app.state["gateway"], host=settings.hostname, port=settings.port,
              log_level=settings.log_level, drain_timeout=settings.drain_timeout)


@main.command()
def plugins() -> None:
    """List installed plugins, their engines (is the device present?) and quantization methods."""
    from switchyard.plugins import PluginHost

    host = PluginHost.from_entry_points()
    if not host.plugins:
        click.echo("no plugins installed (pip install switchyard-xeon for CPUs)")
        return
    click.echo("plugins:")
    for p in host.plugins:
        click.echo(f"  {p.name:<12} {p.distribution} {p.version}")
    click.echo("engines:")
    for row in host.availability():
        mark = "yes" if row.device.available else "no"
        detail = f" ({row.device.detail})" if row.device.detail else ""
        click.echo(f"  {row.engine:<12} plugin={row.plugin} device present={mark}: "
                   f"{row.device.name}{detail}")
    methods = host.quantization_support()
    if methods:
        click.echo("quantization methods (--quantize):")
        for row in methods:
            engines = ", ".join(row.engines) or "none installed"
            click.echo(f"  {row.method:<12} plugin={row.plugin} formats={','.join(row.formats)} "
                       f"engines={engines}: {row.description}")


@main.command()
@click.option("--url", default="http://127.0.0.1:8080", show_default=True,
              help="Server root (a trailing /v1 is fine): Switchyard, TGI, vLLM, ...")
@click.option("--api", default="tgi", show_default=True,
              type=click.Choice(["tgi", "openai-chat", "openai-completions"]),
              help="tgi: /generate_stream; openai-chat: /v1/chat/completions; "
                   "openai-completions: /v1/completions.")
@click.option("--model", default=None, help="`model` for the OpenAI APIs. Default: the server's.")
@click.option("--api-key", envvar="SWITCHYARD_BENCH_API_KEY", default=None,
              help="Sent as `Authorization: Bearer <key>`.")
@click.option("--profile", default="default", show_default=True,
              help="smoke, quick, default, fixed-length or chat; the options below override it.")
@click.option("--rates", default=None, help="Constant request rates, e.g. 0.5,1,2 (req/s). "
                                            "Default: a sweep up to the measured max throughput.")
@click.option("--rate-steps", type=int, default=None, help="Rates in an automatic sweep.")
@click.option("--duration", type=float, default=None, help="Seconds per measured phase.")
@click.option("--max-requests", type=int, default=None, help="Request cap per phase.")
@click.option("--concurrency", type=int, default=None, help="Users in the max-throughput phase.")
@click.option("--no-throughput", is_flag=True, help="Skip the max-throughput phase (needs --rates).")
@click.option("--warmup", type=int, default=None, help="Warmup requests, sent one at a time.")
@click.option("--input-tokens", default=None, help="Prompt tokens: N, or LOW:HIGH sampled.")
@click.option("--output-tokens", default=None, help="max_new_tokens: N, or LOW:HIGH sampled.")
@click.option("--arrival", type=click.Choice(["poisson", "uniform"]), default=None,
              help="Arrivals of the constant-rate phases (profile default: poisson).")
@click.option("--request-timeout", type=float, default=None, help="Seconds per request.")
@click.option("--tokenizer", default=None,
              help="Local tokenizer (model folder or tokenizer.json) to count prompt tokens; "
                   "'server' (its /tokenize) or 'words'. Default: server, else words.")
@click.option("--ignore-eos", is_flag=True,
              help="Ask OpenAI-compatible servers to ignore EOS (vLLM's ignore_eos). Switchyard "
                   "and TGI: start them with TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN=true.")
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help="0 is greedy.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seeds prompts, lengths and arrivals.")
@click.option("--out", "out_dir", default="bench-out", show_default=True,
              help="Folder for bench.json, bench.md and the PNG plots.")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
def bench(**options: object) -> None:
    """Benchmark a TGI or OpenAI-compatible server: warmup, max throughput, constant rates."""
    from switchyard.bench.command import bench_from_cli

    bench_from_cli(options)


@main.command()
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write the document to this file instead of standard output.")
def openapi(output: str | None) -> None:
    """Print the HTTP API's OpenAPI document, as served at /openapi.json.

    `switchyard openapi -o spec/openapi.json` regenerates the checked-in copy.
    """
    from switchyard.app import create_app
    from switchyard.openapi import render_document
    from switchyard.settings import ServeSettings

    # Default settings: building the app loads no model (that happens when it starts).
    text = render_document(create_app(ServeSettings()))
    if output is None:
        click.echo(text, nl=False)
    else:
        with open(output, "w", encoding="utf-8") as out:
            out.write(text)


if __name__ == "__main__":
    main()
