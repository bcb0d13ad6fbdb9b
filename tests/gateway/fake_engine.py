"""A scripted engine and a live app around it, for route tests that need no model weights.

`ScriptedEngine` answers every request at once, from the caller's thread, with
tokens and log-probabilities chosen by the test; it records every request so a
test can check what the gateway asked of the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from litestar.testing import TestClient

from switchyard.app import create_app
from switchyard.models.served import Admission, ServedModel
from switchyard.plugins import PluginHost
from switchyard.settings import ServeSettings, TokenLimits
from switchyard.text import TextTokenizer, load_tokenizer
from switchyard_spec import (
    DeviceInfo,
    Engine,
    EngineRequest,
    EngineSpec,
    EngineStats,
    EventSink,
    FinishReason,
    ModelInfo,
    TokenEvent,
    WarmupReport,
)

TOKEN_IDS = (400, 401, 402, 403, 404, 405, 406, 407)
"""What the engine generates, in order (ordinary tokens of the default model)."""


class ScriptedEngine(Engine):
    """Emits `token_ids` (`TOKEN_IDS` unless a test sets them; up to `max_new_tokens`)
    for each request, synchronously.

    `logprob(k)` gives the logprob of every token of the k-th request (0-based);
    `fail_after` set makes requests fail with an error event after that many tokens.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.token_ids: tuple[int, ...] = TOKEN_IDS
        self.requests: list[EngineRequest] = []
        self.aborted: list[str] = []
        self.probes = 0
        self.fail_after: int | None = None
        self.logprob: Callable[[int], float] = lambda k: -1.0

    def start(self) -> ModelInfo:  # never called: the test loader builds the model
        raise NotImplementedError

    def warmup(self) -> WarmupReport:
        raise NotImplementedError

    def submit(self, request: EngineRequest, sink: EventSink) -> None:
        k = len(self.requests)
        self.requests.append(request)
        n_prompt = len(request.prompt_token_ids)
        count = min(request.stopping.max_new_tokens, len(self.token_ids))
        for i in range(count):
            first = i == 0
            if self.fail_after is not None and i == self.fail_after:
                sink(TokenEvent(request_id=request.request_id, token_id=-1,
                                error="scripted failure", prompt_tokens=n_prompt))
                return
            sink(TokenEvent(
                request_id=request.request_id,
                token_id=self.token_ids[i],
                logprob=self.logprob(k),
                finish_reason=FinishReason.LENGTH if i == count - 1 else None,
                seed=request.sampling.seed,
                prompt_tokens=n_prompt,
                prompt_logprobs=(tuple(-0.5 - j for j in range(n_prompt - 1))
                                 if first and request.prompt_logprobs else ()),
            ))

    def probe_liveness(self, timeout: float = 30.0) -> bool:
        """Alive unless requests are scripted to fail; counts the calls."""
        self.probes += 1
        return self.fail_after is None

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(running=0, waiting=0)

    def shutdown(self) -> None:
        pass


def served_model(model_path: Path, engine: ScriptedEngine, tokenizer: TextTokenizer) -> ServedModel:
    """The default model's tokenizer bound to a scripted engine."""
    return ServedModel(
        name="fake",
        model_id="fake",
        tokenizer=tokenizer,
        engine=engine,
        engine_spec=EngineSpec(
            name="scripted", description="scripted test engine", factory=lambda config: engine,
            probe=lambda: DeviceInfo(available=True, name="none"),
        ),
        info=ModelInfo(model_type="llama", dtype="float32", vocab_size=engine.vocab_size,
                       max_position_embeddings=512, eos_token_ids=tokenizer.eos_token_ids,
                       device="cpu"),
        limits=TokenLimits(max_input_tokens=400, max_total_tokens=512),
        admission=Admission(limit=8),
    )


@contextmanager
def scripted_app(
    model_path: Path, **settings: object
) -> Iterator[tuple[TestClient, ScriptedEngine]]:
    """A started app serving a scripted engine, and the engine."""
    tokenizer = load_tokenizer(model_path)
    engine = ScriptedEngine(tokenizer.vocab_size)
    model = served_model(model_path, engine, tokenizer)
    app = create_app(ServeSettings(**settings),  # type: ignore[arg-type]
                     plugins=PluginHost(), loader=lambda s, p: model)
    with TestClient(app, timeout=30) as client:
        deadline = time.monotonic() + 30
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the scripted app never became ready"
            time.sleep(0.05)
        yield client, engine
