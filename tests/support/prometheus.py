"""A Prometheus text exposition (``GET /metrics``), parsed by the tests into types and samples."""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass
class Scrape:
    """A parsed exposition: `# TYPE`s and samples (name, labels, value)."""

    text: str
    types: dict[str, str] = field(default_factory=dict)
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str) -> Scrape:
        scrape = cls(text)
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(" ")
                scrape.types[name] = kind
            elif line and not line.startswith("#"):
                match = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)", line)
                assert match, f"unparsable sample line: {line!r}"
                labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(2) or ""))
                scrape.samples.append((match.group(1), labels, float(match.group(3))))
        return scrape

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 when none)."""
        return sum(v for n, ls, v in self.samples
                   if n == name and all(ls.get(k) == w for k, w in labels.items()))

    def bounds(self, name: str) -> list[str]:
        """The `le` strings of histogram `name`'s buckets, in order, for our model."""
        text_bounds = re.findall(rf'^{name}_bucket\{{[^}}]*le="([^"]+)"', self.text, re.M)
        return list(dict.fromkeys(text_bounds))
