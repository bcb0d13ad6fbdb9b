"""Prompts of a chosen length, counted in the served model's tokens.

A prompt is a slice of a generated English corpus, cut on token boundaries.
The boundaries come, in order of preference, from a local tokenizer
(`--tokenizer PATH`), from the server's own `POST /tokenize` (TGI and
Switchyard have it), or from a words-as-tokens estimate. Random start offsets
make every prompt different, so a prefix cache cannot turn the benchmark into
a cache benchmark.
"""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import msgspec

# Common words; sentences of them tokenize like ordinary English prose.
_WORDS = """the of and to in is that it for was on are as with his they at be this from have or
one had by word but not what all were we when your can said there use an each which she do how
their if will up other about out many then them these so some her would make like him into time
has look two more write go see number no way could people my than first water been call who oil
its now find long down day did get come made may part over new sound take only little work know
place year live me back give most very after thing our just name good sentence man think say
great where help through much before line right too mean old any same tell boy follow came want
show also around form three small set put end does another well large must big even such because
turn here why ask went men read need land different home us move try kind hand picture again
change off play spell air away animal house point page letter mother answer found study still
learn should world high every near add food between own below country plant last school father
keep tree never start city earth eye light thought head under story saw left few while along
might close something seem next hard open example begin life always those both paper together
got group often run important until children side feet car mile night walk white sea began grow
took river four carry state once book hear stop without second later miss idea enough eat face
watch far really almost let above girl sometimes mountain cut young talk soon list song being
leave family""".split()


class Prompt(msgspec.Struct, frozen=True):
    """A prompt and its length in tokens as the prompt builder counted it."""

    text: str
    tokens: int


class _Span(msgspec.Struct, frozen=True, array_like=True):
    start: int
    stop: int


class _ServerToken(msgspec.Struct):
    start: int
    stop: int


def corpus_text(words: int, seed: int) -> str:
    """Deterministic prose of `words` words: sentences of 6 to 18 words."""
    rng = random.Random(seed)
    sentences: list[str] = []
    left = words
    while left > 0:
        n = min(left, rng.randint(6, 18))
        chosen = [rng.choice(_WORDS) for _ in range(n)]
        sentences.append(" ".join(chosen).capitalize() + ".")
        left -= n
    return " ".join(sentences)


class PromptBuilder:
    """Cuts prompts of N tokens out of a tokenized corpus."""

    def __init__(self, text: str, spans: list[_Span], source: str) -> None:
        # Special tokens (BOS and the like) have empty spans and take no text: skip them.
        self._text = text
        self._spans = [s for s in spans if s.stop > s.start]
        self.source = source
        """Where token boundaries came from: a tokenizer path, `server` or `words`."""

    @property
    def capacity(self) -> int:
        """The longest prompt this corpus can give."""
        return len(self._spans)

    def build(self, tokens: int, rng: random.Random) -> Prompt:
        """A prompt of `tokens` tokens starting at a random token of the corpus."""
        if tokens > self.capacity:
            raise ValueError(f"prompt of {tokens} tokens asked, the corpus has {self.capacity}")
        first = rng.randint(0, self.capacity - tokens)
        start = self._spans[first].start
        stop = self._spans[first + tokens - 1].stop
        # A slice can start with the space that belongs to its first token; keeping it keeps
        # the count (stripping it would change how that token is split).
        return Prompt(text=self._text[start:stop], tokens=tokens)


def _word_spans(text: str) -> list[_Span]:
    spans, pos = [], 0
    for word in text.split(" "):
        spans.append(_Span(pos, pos + len(word)))
        pos += len(word) + 1
    return spans


def words_builder(words: int, seed: int) -> PromptBuilder:
    """Fallback: one word counts as one token (close for English on large vocabularies)."""
    text = corpus_text(words, seed)
    return PromptBuilder(text, _word_spans(text), "words")


def local_builder(path: str, words: int, seed: int) -> PromptBuilder:
    """Token boundaries from a local tokenizer: a model folder or a `tokenizer.json` file."""
    text = corpus_text(words, seed)
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if file.is_file():
        from tokenizers import Tokenizer

        encoding = Tokenizer.from_file(str(file)).encode(text, add_special_tokens=False)
        offsets = encoding.offsets
    else:
        # No tokenizer.json: let transformers find a fast tokenizer (also hub ids in the cache).
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)[
            "offset_mapping"]
    return PromptBuilder(text, [_Span(a, b) for a, b in offsets], path)


async def server_builder(client: httpx.AsyncClient, url: str, words: int,
                         seed: int) -> PromptBuilder | None:
    """Token boundaries from the server's `POST /tokenize`; None where it has none.

    Raises `httpx.TransportError` when the server cannot be reached at all.
    """
    text = corpus_text(words, seed)
    reply = await client.post(f"{url}/tokenize", json={"inputs": text}, timeout=60)
    if reply.status_code != 200:
        return None
    try:
        tokens = msgspec.json.decode(reply.content, type=list[_ServerToken])
    except msgspec.ValidationError:
        return None
    return PromptBuilder(text, [_Span(t.start, t.stop) for t in tokens], "server")


def corpus_words(max_prompt_tokens: int) -> int:
    """A corpus size that leaves room for random offsets under the longest prompt.

    Tokenizers with small vocabularies need more than one token per word, so
    words are at least as many as tokens: the corpus always has enough tokens.
    """
    return max(2 * max_prompt_tokens + 512, 2048)
