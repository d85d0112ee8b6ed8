"""Formatting shared by the benchmark reports: aligned text tables, Markdown tables, load averages;
and writing a report out."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kestrel.bench.common import log


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Lines of an aligned table: the first column left-aligned, the rest right-aligned."""
    rows = [tuple(header), *map(tuple, rows)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
            for r in rows]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return [f"| {' | '.join(header)} |", "|" + "---|" * len(header), *(f"| {' | '.join(r)} |" for r in rows)]


def load_averages(report: dict[str, Any]) -> str:
    """'load average at start a, b, c, at end x, y, z' from a report's recorded load averages."""
    def fmt(loads: Sequence[float]) -> str:
        return ", ".join(f"{x:.2f}" for x in loads)
    return (f"load average at start {fmt(report['load_average_at_start'])}, "
            f"at end {fmt(report['load_average_at_end'])}")


def write_report(report: dict, summary: str, markdown: str, output_json: str | None,
                 append_md: str | None) -> None:
    """Print a benchmark's summary; write its JSON and append its Markdown section when asked."""
    print(summary)
    if output_json:
        Path(output_json).write_text(json.dumps(report, indent=2) + "\n")
        log(f"wrote {output_json}")
    if append_md:
        with open(append_md, "a") as f:
            f.write(markdown)
        log(f"appended to {append_md}")
