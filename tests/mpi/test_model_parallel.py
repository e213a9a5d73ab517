"""Model parallelism across processes equals `single`: tensor, pipeline, hybrid, layer-split and
dp-pmap on one jax.distributed mesh over the ranks, and `mpi-pipeline` (one stage per rank).

Each strategy runs on the launched world (2 ranks in `make test`; tests/test_mpi_launch.py
launches 4, and 2 ranks of 2 devices each) and matches `single` run in-process on the same
global batches (the equivalence protocol). Sizes follow the world: S stages, tensor=S.

    mpiexec -n 2 python -m mpi4py -m pytest -q tests/mpi/test_model_parallel.py
"""

import jax
import pytest

import equivalence as eq
from jaxpar import measure
from jaxpar.parallel import STRATEGIES

# (strategy, options): every model-parallel strategy, both pipeline schedules and --remat.
CASES = [("tensor", {}), ("tensor-auto", {}), ("pipeline", {"schedule": "gpipe"}),
         ("pipeline", {"schedule": "1f1b", "remat": True}), ("hybrid", {}),
         ("layer-split", {}), ("dp-pmap", {}),
         ("mpi-pipeline", {"schedule": "gpipe"}), ("mpi-pipeline", {"schedule": "1f1b"})]


@pytest.mark.parametrize("strategy,options", CASES, ids=lambda c: c if isinstance(c, str) else
                         "-".join(f"{k}={v}" for k, v in c.items()))
def test_equivalent_to_single(comm, stack_reference, stack_config, strategy, options):
    got = eq.run(stack_config(strategy=strategy, **options), steps=5)
    eq.assert_equivalent(stack_reference, got)
    assert set(got.strategy.trace_counts.values()) == {1}  # every program traced once
    described = got.strategy.describe()
    if STRATEGIES[strategy].uses_mpi:
        assert described["processes"] == comm.Get_size()
    else:  # one global mesh over every process's devices
        assert described["devices"] == len(jax.devices())
        assert described["process_layout"]["processes"] == comm.Get_size()

def test_hybrid_keeps_tensor_within_a_process(stack_config):
    """With several devices per process the default puts tensor within, stage across."""
    if jax.local_device_count() < 2:
        pytest.skip("needs 2 devices per process (JAXPAR_MPI_DEVICES=2)")
    layout = eq.run(stack_config(strategy="hybrid"), steps=1).strategy.describe()["process_layout"]
    assert layout["axes"] == {"tensor": "within", "stage": "across"}


def test_mpi_pipeline_bytes_bubble_and_state_per_rank(comm, stack_config):
    """Point-to-point bytes counted in each rank's compiled step equal the schedule's theory;
    the bubble is GPipe's; each rank holds its 1/S of the blocks and nothing of the others'."""
    S, s = comm.Get_size(), comm.Get_rank()
    cfg = stack_config(strategy="mpi-pipeline", optimizer="momentum")
    t = eq.run(cfg, steps=1)
    batch = t.strategy.place_batch(eq.batches(cfg.data.batch_size, 1)[0])
    acc = t.strategy.accounting(t.strategy.compile("step", t.state, batch), t.state)
    theory, p2p = acc["collective_bytes_theory"], acc["point_to_point_bytes_per_step"]
    assert p2p == {"sent": theory["point_to_point_sent"], "received": theory["point_to_point_received"]}
    assert acc["collective_bytes_per_step"] == theory["total"] > 0
    assert comm.allreduce(p2p["sent"]) == theory["pipeline_point_to_point"]
    M = cfg.parallel.microbatches
    assert acc["bubble_fraction"] == pytest.approx(acc["bubble_theory"]) == (S - 1) / (M + S - 1)
    blocks = measure.tree_bytes(t.state.params["blocks"])
    every_block = measure.tree_bytes(t.params["blocks"])
    assert blocks * S == every_block  # its share of the blocks, and of their momentum
    assert 0 <= measure.tree_bytes(t.state.opt_state) - measure.tree_bytes(t.state.params) <= 16
    assert set(t.state.params) == {"blocks"} | ({"stem"} if s == 0 else set()) | (
        {"head"} if s == S - 1 else set())
    depth = len(t.params["blocks"])
    assert sorted(t.state.params["blocks"]) == list(range(s * depth // S, (s + 1) * depth // S))
