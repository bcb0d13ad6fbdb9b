"""Prometheus text exposition with TGI's names: counters without a `_total` suffix.

prometheus_client's own `generate_latest` follows OpenMetrics naming and
writes a counter `tgi_request_count` as `tgi_request_count_total` (and adds
`*_created` series). TGI's exporter (metrics-exporter-prometheus) writes the
name as registered, and dashboards and alerts built on TGI query those names,
so this module renders the registry the way TGI's exporter does:

- counters keep their registered name (`# TYPE tgi_request_count counter`,
  `tgi_request_count{...} 3`);
- no `*_created` series;
- numbers as Rust's `Display` writes them (`le="4"`, not `le="4.0"`), so
  bucket label values are the strings TGI exposes.

Content type: the Prometheus text format, version 0.0.4.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from decimal import Decimal

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def format_number(value: float) -> str:
    """A sample value or bucket bound as Rust's `Display` writes an f64."""
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 2**63:
        return str(int(value))
    text = repr(value)
    # Python switches to exponent notation below 1e-4 and from 1e16; Rust never does.
    return format(Decimal(text), "f") if "e" in text else text


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _label_value(key: str, value: str) -> str:
    # Bucket bounds are numbers prometheus_client wrote Python's way ("4.0").
    return format_number(float(value)) if key == "le" else _escape_label(value)


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _sample_name(family: Metric, name: str) -> str | None:
    """The name a sample is written under; None for samples TGI has no counterpart of."""
    if name.endswith("_created"):
        return None
    if family.type == "counter" and name == family.name + "_total":
        return family.name
    return name


def render(collectors: Iterable[Collector]) -> bytes:
    """Every metric the collectors report, in the text format TGI's exporter writes."""
    lines: list[str] = []
    for collector in collectors:
        for family in collector.collect():
            kind = "untyped" if family.type == "unknown" else family.type
            lines.append(f"# HELP {family.name} {_escape_help(family.documentation)}")
            lines.append(f"# TYPE {family.name} {kind}")
            for sample in family.samples:
                name = _sample_name(family, sample.name)
                if name is None:
                    continue
                if sample.labels:
                    pairs = ",".join(f'{key}="{_label_value(key, value)}"'
                                     for key, value in sample.labels.items())
                    name = f"{name}{{{pairs}}}"
                lines.append(f"{name} {format_number(sample.value)}")
    lines.append("")
    return "\n".join(lines).encode()
