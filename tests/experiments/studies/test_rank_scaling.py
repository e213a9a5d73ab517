"""The scaling study's rank mode: single-threaded MPI ranks under this venv's mpiexec beside
their single-process baselines; the summary's speed-ups are ratios of the recorded images/s.

    python -m pytest -q tests/experiments/studies/test_rank_scaling.py
"""

import re
import subprocess
import sys
import time

import pytest

from experiments.__main__ import EXIT_USAGE, run
from experiments.points.mpi import mpiexec
from experiments.points.points import run_point
from jaxpar import results

needs_mpi = pytest.mark.skipif(
    not mpiexec().exists() or subprocess.run(
        [sys.executable, "-c", "import mpi4jax"], capture_output=True).returncode != 0,
    reason="needs the `mpi` extra in this venv (make test installs it)")


def _row(table: str, strategy: str, ranks: int) -> list[str]:
    """Cells of the rank table's row for `strategy` at `ranks`."""
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) > 4 and cells[2] == strategy and cells[3].split()[0] == str(ranks) and "threads" not in line:
            return cells
    raise AssertionError(f"no row for {strategy} at {ranks} ranks in:\n{table}")


@needs_mpi
def test_quick_rank_scaling_records_the_world_and_ratios(tmp_path):
    assert run(["scaling", "--quick", "--ranks", "1,2", "--device-counts", "1", "--out", str(tmp_path)]) == 0
    two = results.load(tmp_path / "ranks/strong/mlp-mpi-allreduce-r2/r0")
    one = results.load(tmp_path / "ranks/strong/mlp-single-r1/r0")
    best = results.load(tmp_path / "strong/mlp-single-1/r0")  # the only single-process point here
    assert two.env["mpi_ranks"] == two.strategy["processes"] == 2
    assert one.env["mpi_ranks"] == 1
    assert two.env["threads_per_process"] == one.env["threads_per_process"] == 1
    assert best.env["threads_per_process"] == best.env["cores_available"]
    m = two.metrics
    assert m["collective_bytes_per_step"] == m["collective_bytes_theory"]["total"] > 0
    cells = _row((tmp_path / "summary.md").read_text(), "mpi-allreduce", 2)
    ips_one, ips_two, ips_best = (r.metrics["images_per_sec"] for r in (one, two, best))
    assert float(cells[8]) == pytest.approx(ips_two / ips_one, abs=0.006)   # vs 1 rank
    assert float(cells[9]) == pytest.approx(ips_two / ips_one / 2, abs=0.006)  # efficiency
    assert float(cells[10]) == pytest.approx(ips_two / ips_best, abs=0.006)  # vs best 1-process


def test_rank_mode_rejects_a_single_process_strategy_before_any_work(tmp_path, capsys):
    out = tmp_path / "never"
    code = run(["scaling", "--ranks", "1,2", "--rank-strategies", "single", "--out", str(out)])
    assert code == EXIT_USAGE
    assert "mpi-allreduce" in capsys.readouterr().err  # names strategies that can
    assert not out.exists()


@needs_mpi
def test_a_point_past_its_timeout_takes_its_ranks_with_it():
    marker = f"{time.time() % 1000 + 100:.3f}"  # a sleep argument no other process has
    with pytest.raises(RuntimeError, match="ran past"):
        run_point([str(mpiexec()), "-n", "2", "sleep", marker], timeout=2)
    time.sleep(1)
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert not re.search(rf"^sleep {re.escape(marker)}$", ps, re.M), ps


@needs_mpi
def test_quick_rank_study_takes_the_model_parallel_strategies(tmp_path):
    """tensor and pipeline on one jax.distributed mesh over 2 single-threaded ranks, and
    mpi-pipeline (a stage per rank): images/s, bytes per rank against theory, state per rank."""
    args = ["scaling", "--quick", "--ranks", "1,2", "--device-counts", "1", "--models", "stack-mlp",
            "--depth", "2", "--rank-strategies", "tensor,pipeline,mpi-pipeline", "--out", str(tmp_path)]
    assert run(args) == 0
    one = results.load(tmp_path / "ranks/strong/stack-mlp-single-r1/r0")
    table = (tmp_path / "summary.md").read_text()
    for name in ("tensor", "pipeline", "mpi-pipeline"):
        r = results.load(tmp_path / f"ranks/strong/stack-mlp-{name}-r2/r0")
        m = r.metrics
        assert r.env["mpi_ranks"] == 2 and r.env["threads_per_process"] == 1
        assert m["images_per_sec"] > 0 and m["collective_bytes_theory"]["total"] > 0
        # on the wire by the compiled step, as the strategy's theory says (tensor, mpi-pipeline)
        if name != "pipeline":
            assert m["collective_bytes_per_step"] == m["collective_bytes_theory"]["total"], name
        assert 0 < m["state_bytes_per_device"] < one.metrics["state_bytes_per_device"], name
        cells = _row(table, name, 2)
        assert cells[-1] == f"{m['state_bytes_per_device']:,}"
        assert cells[3] == "2" if r.env["cpu_cores"] >= 2 else "oversubscribed" in cells[3]


def test_a_rank_strategy_that_places_none_of_the_models_is_refused(tmp_path, capsys):
    out = tmp_path / "never"
    code = run(["scaling", "--ranks", "1,2", "--rank-strategies", "hybrid", "--models", "mlp", "--out", str(out)])
    assert code == EXIT_USAGE
    assert "--models stack-mlp or vit" in capsys.readouterr().err
    assert not out.exists()
