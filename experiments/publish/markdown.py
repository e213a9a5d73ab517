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


# --- numbers in sentences (the generated findings) -------------------------------------------
def times(x: float, digits: int = 2) -> str:
    """A ratio as prose writes it: 1.52x."""
    return f"{x:.{digits}f}x"


def span(values, fmt: str = ".2f", unit: str = "") -> str:
    """'1.08-1.57x' (the smallest and largest of `values`), or one value when they agree as
    written."""
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"


def percent(x: float, signed: bool = False) -> str:
    """A fraction as a whole percentage: 0.896 -> '90%' (signed: '+12%', '-9%')."""
    return f"{100 * x:+.0f}%" if signed else f"{100 * x:.0f}%"


def listing(words: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    words = list(words)
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def bullets(lines: list[str]) -> str:
    """A markdown list, one finding a line."""
    return "\n".join(f"- {line}" for line in lines)
