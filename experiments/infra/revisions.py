"""Two checkouts of jaxpar against each other, alternated: did a change move the step?

Each configuration is a `bench` of the CNN in a fresh process from each checkout, the two
alternated round by round (which goes first swapped every round), so that a slow spell of a
shared machine falls on both; a configuration's row is the median of its rounds on each side.
The results land in OUT/<side>/<config>/r<k>/ (a stopped run resumes), OUT/revisions.json and
OUT/summary.md (the two to keep: an old checkout's results may name its machine's folders).

    git worktree add /tmp/old <revision>
    python -m experiments.infra.revisions --old /tmp/old --new . --rounds 5 --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from experiments.cli import revisions_arguments
from experiments.points.mpi import mpiexec
from experiments.publish.markdown import markdown
from jaxpar import results

COMMON = ["--model", "cnn", "--dataset", "synthetic", "--iters", "20", "--warmup", "3", "--no-matmul-peak"]
PIPELINE = ["--strategy", "pipeline", "--devices", "2", "--mesh", "stage=2", "--microbatches", "8"]
# name: (ranks or None for one process, bench's options beside COMMON)
BENCHES = {
    "single": (None, ["--strategy", "single"]),
    "dp-shard-map": (None, ["--strategy", "dp-shard-map", "--devices", "2"]),
    "pipeline-gpipe": (None, [*PIPELINE, "--schedule", "gpipe"]),
    "pipeline-1f1b": (None, [*PIPELINE, "--schedule", "1f1b"]),
    "tensor": (None, ["--strategy", "tensor", "--devices", "2"]),
    "mpi-pipeline-ranks": (2, ["--strategy", "mpi-pipeline", "--microbatches", "8", "--schedule", "1f1b", "--single-thread"]),
    "pipeline-ranks": (2, ["--strategy", "pipeline", "--microbatches", "8", "--schedule", "1f1b", "--single-thread"]),
}


def bench(tree: Path, name: str, folder: Path, timeout: float) -> float:
    """The median step (ms) of `name` benched from checkout `tree` into `folder` (reused when there)."""
    if not (folder / results.RESULT_FILE).exists():
        ranks, options = BENCHES[name]
        cmd = [sys.executable, "-m", "experiments", "bench", *COMMON, *options, "--out", str(folder.resolve())]
        if ranks:
            cmd = [str(mpiexec()), "-n", str(ranks), *cmd]
        env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "JAX_PLATFORMS": "cpu"}
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode:
            raise RuntimeError(f"{name} from {tree} failed:\n{done.stderr[-1500:]}")
    return results.load(folder / results.RESULT_FILE).metrics["step_time_ms_median"]


def alternate(trees: dict[str, Path], names: list[str], rounds: int, out: Path, timeout: float) -> dict:
    """{config: {side: [ms by round]}}, each round both sides of each config back to back."""
    got = {n: {side: [] for side in trees} for n in names}
    for k in range(rounds):
        for n in names:
            for side in (list(trees) if k % 2 == 0 else list(trees)[::-1]):
                got[n][side].append(bench(trees[side], n, out / side / n / f"r{k}", timeout))
                print(f"r{k} {n:20s} {side}: {got[n][side][-1]:.2f} ms", flush=True)
    return got


def ab_table(got: dict) -> str:
    """Per config: each side's rounds and median, the ratio of the medians, and the median of
    the rounds' own ratios (each round runs both sides back to back, so a slow spell of the
    machine falls on both: the paired ratio is the steadier of the two)."""
    rows = []
    for n, sides in got.items():
        old, new = statistics.median(sides["old"]), statistics.median(sides["new"])
        paired = statistics.median(b / a for a, b in zip(sides["old"], sides["new"]))
        rows.append([n, ", ".join(f"{x:.2f}" for x in sides["old"]), ", ".join(f"{x:.2f}" for x in sides["new"]),
                     f"{old:.2f}", f"{new:.2f}", f"{new / old:.3f}", f"{paired:.3f}"])
    return markdown(["config", "old: ms/step by round", "new: ms/step by round", "median old",
                     "median new", "new / old", "median of round ratios"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.infra.revisions", description=__doc__.split("\n")[0])
    revisions_arguments(parser, BENCHES)
    args = parser.parse_args(argv)
    names = args.configs.split(",")
    if bad := [n for n in names if n not in BENCHES]:
        parser.error(f"--configs {','.join(bad)}: choose from {', '.join(BENCHES)}")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    trees = {"old": args.old, "new": args.new}
    out = results.ensure_writable(args.out)
    got = alternate(trees, names, args.rounds, out, args.timeout)
    revs = {side: subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=t, capture_output=True,
                                 text=True).stdout.strip() for side, t in trees.items()}
    summary = ab_table(got) + f"\n\n*old:* {revs['old']}, *new:* {revs['new']}; {args.rounds} alternated rounds.\n"
    results.write_atomic(out / "revisions.json", json.dumps({"revisions": revs, "ms": got}, indent=1) + "\n")
    results.write_atomic(out / "summary.md", summary)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
