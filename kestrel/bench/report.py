"""Formatting shared by the benchmark reports: aligned text tables, Markdown tables, load averages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


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
