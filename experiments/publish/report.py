"""Write every results table, and every sentence of findings, in README.md and docs/ from the
committed results, the way `figures` redraws the PNGs; `--check` changes nothing and fails
naming each stale one. Either way a measured number typed into the prose around them (outside
the markers: `experiments.publish.typed`) fails too, named: measurements are generated.

    python -m experiments report             # rewrite the tables between their markers
    python -m experiments report --check     # exit 1 naming every table that differs

A generated table sits between two markers, each on a line of its own, in a markdown file;
everything between them is replaced by `experiments.tables.TABLES[NAME](data folder)`:

    <!-- report:scaling-devices -->
    | model | strategy | ... |
    <!-- /report:scaling-devices -->

A marker naming no table, an unclosed marker, or a missing or damaged results file exits 2
naming it (and writes nothing).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from experiments.options import option
from experiments.publish.tables import TABLES
from experiments.publish.typed import typed_measurements
from jaxpar.errors import ConfigError
from jaxpar.results import write_atomic

# Markers stand on lines of their own (a marker quoted inside a sentence is not one).
_BLOCK = re.compile(r"^(<!-- report:([\w\-]+) -->\n)(.*?)^(<!-- /report:\2 -->)$", re.S | re.M)
_OPEN = re.compile(r"^<!-- report:([\w\-]+) -->$", re.M)


@dataclass(frozen=True)
class ReportOptions:
    data: str = option("figures/data", "results folder")
    root: str = option(".", "folder holding README.md and docs/")
    check: bool = option(False, "write nothing; exit 1 naming each table that differs from the results")


def documents(root: Path) -> list[Path]:
    """README.md and every markdown file under docs/ (the published pages)."""
    return [p for p in [root / "README.md", *sorted((root / "docs").rglob("*.md"))] if p.is_file()]


def render(text: str, data_dir: Path, where: str) -> tuple[str, list[str]]:
    """`text` with every marked table regenerated, and the names of the tables that changed.

    Raises:
      ConfigError: a marker names no table, or is not closed.
    """
    closed = {m.group(2) for m in _BLOCK.finditer(text)}
    for m in _OPEN.finditer(text):
        name = m.group(1)
        if name not in TABLES:
            raise ConfigError(f"{where}: <!-- report:{name} --> names no table; known: {', '.join(TABLES)}")
        if name not in closed:
            raise ConfigError(f"{where}: <!-- report:{name} --> has no closing <!-- /report:{name} -->")
    changed: list[str] = []

    def fill(m: re.Match) -> str:
        table = TABLES[m.group(2)](data_dir).rstrip("\n") + "\n"
        if table != m.group(3):
            changed.append(m.group(2))
        return m.group(1) + table + m.group(4)

    return _BLOCK.sub(fill, text), changed


def report(root: Path, data_dir: Path, check: bool) -> list[str]:
    """Regenerate (or with `check`, only compare) every marked table; return 'FILE: NAME' for
    each table that differed. Every file is rendered before any is written."""
    rendered, stale = {}, []
    for path in documents(root):
        text = path.read_text()
        new, changed = render(text, data_dir, str(path))
        stale += [f"{path.relative_to(root)}: report:{name}" for name in changed]
        if new != text:
            rendered[path] = new
    if not check:
        for path, text in rendered.items():
            write_atomic(path, text)
    return stale


def run(args: ReportOptions) -> list[str] | None:
    """The CLI: the tables rewritten (or found current), or None when `--check` found stale
    ones (the CLI's exit status 1, as for a study that failed)."""
    root = Path(args.root)
    if not (root / "README.md").is_file():
        raise ConfigError(f"no README.md in {root.resolve()}; run from the repository root or pass --root")
    stale = report(root, Path(args.data), args.check)
    typed = typed_measurements(root, documents(root))
    if typed:
        print("measured numbers typed into the prose (generate them from the results, or list a "
              "number that is no measurement in experiments/publish/typed.py):\n  " + "\n  ".join(typed),
              file=sys.stderr)
    if args.check and stale:
        print("stale tables (run `python -m experiments report`):\n  " + "\n  ".join(stale), file=sys.stderr)
        return None
    print(f"rewrote {', '.join(stale)}" if stale else
          f"every table in {len(documents(root))} file(s) matches {args.data}")
    return None if typed else stale
