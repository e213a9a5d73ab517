"""Redraw every figure from committed results alone.

    python -m experiments figures --data figures/data --out figures
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", default="figures/data", help="results folder (default: figures/data)")
    p.add_argument("--out", default="figures", help="PNG folder (default: figures)")


def run(args: argparse.Namespace) -> list[Path]:
    from experiments.plots import redraw

    paths = redraw(args.data, args.out)
    for p in paths:
        print(f"wrote {p}")
    return paths
