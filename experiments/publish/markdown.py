"""Markdown tables and cells for the generated tables (every study's tables module)."""

from __future__ import annotations

from typing import Any

DASH = "–"


def markdown(header: list[str], rows: list[list[Any]]) -> str:
    """A GitHub table; `|` inside a cell is escaped."""
    cell = lambda v: str(v).replace("|", "\\|")
    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def num(x: float | None, digits: int = 0) -> str:
    return DASH if x is None else f"{x:,.{digits}f}"


def mb(x: float | None) -> str:
    return DASH if x is None else f"{x / 1e6:,.1f}"


def theory_total(theory: Any) -> int | None:
    """A result's collective-bytes theory as one number (None: no closed form)."""
    if isinstance(theory, dict):
        return theory.get("total")
    return theory
