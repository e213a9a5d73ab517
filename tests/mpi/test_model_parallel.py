"""Model parallelism across processes equals `single`: tensor, pipeline, hybrid, layer-split and
dp-pmap on one jax.distributed mesh over the ranks, and `mpi-pipeline` (one stage per rank).

Each strategy runs on the launched world (2 ranks in `make test`; tests/test_mpi_worlds.py
launches 4, and 2 ranks of 2 devices each) and matches `single` (run by rank 0 on its own
device, sent to all) on the same global batches (the equivalence protocol). Sizes follow the
world: S stages, tensor=S.

    mpiexec -n 2 python -m mpi4py -m pytest -q tests/mpi/test_model_parallel.py
"""

import jax
import pytest

import equivalence as eq
from jaxpar.profiling import measure
from jaxpar.parallel import STRATEGIES
from jaxpar.parallel.pipeline import schedules

# (strategy, options): every model-parallel strategy, both pipeline schedules and --remat.
CASES = [("tensor", {}), ("tensor-auto", {}), ("pipeline", {"schedule": "gpipe"}),
         ("pipeline", {"schedule": "1f1b", "remat": True}), ("hybrid", {}),
         ("layer-split", {}), ("dp-pmap", {}),
         ("mpi-pipeline", {"schedule": "gpipe"}), ("mpi-pipeline", {"schedule": "1f1b"})]
# Every other schedule across the ranks, over jax.distributed and over MPI (stack-mlp: 8 layers
# hold 2 stages per rank on 4 ranks; dualpipev needs a micro-batch per stage). Not among the
# tests that cross emulated hosts (tests/cross_host.py): a schedule changes what each process
# runs, not how its messages travel.
SCHEDULES = [("interleaved-1f1b", {}), ("looped-bfs", {}), ("zb-h1", {}), ("zb-h1", {"remat": True}),
             ("zbv", {}), ("dualpipev", {"microbatches": 8})]


# What a world of 4 ranks would only repeat of 2 (tests/test_mpi_worlds.py; the suite's time):
# the compiler's tensor split, the layer split and pmap place one shard or layer per process
# whatever their number; mpi-pipeline's GPipe differs from its 1F1B in the order of one table.
SAME_ON_MORE_RANKS = {("tensor-auto", ""), ("layer-split", ""), ("dp-pmap", ""), ("mpi-pipeline", "gpipe")}


def _on_two_ranks_only(comm, strategy, schedule=""):
    if comm.Get_size() > 2 and (strategy, schedule) in SAME_ON_MORE_RANKS:
        pytest.skip(f"{strategy} {schedule}: what 4 ranks do alike is tested on 2")


def _ids(c):
    return c if isinstance(c, str) else "-".join(f"{k}={v}" for k, v in c.items())


def _equivalent_to_single(comm, stack_reference, stack_config, strategy, options):
    got = eq.run(stack_config(strategy=strategy, **options), steps=5)
    eq.assert_equivalent(stack_reference, got)
    assert set(got.strategy.trace_counts.values()) == {1}  # every program traced once
    described = got.strategy.describe()
    if STRATEGIES[strategy].uses_mpi:
        assert described["processes"] == comm.Get_size()
    else:  # one global mesh over every process's devices
        assert described["devices"] == len(jax.devices())
        assert described["process_layout"]["processes"] == comm.Get_size()


@pytest.mark.parametrize("strategy,options", CASES, ids=_ids)
def test_equivalent_to_single(comm, stack_reference, stack_config, strategy, options):
    _on_two_ranks_only(comm, strategy, options.get("schedule", ""))
    _equivalent_to_single(comm, stack_reference, stack_config, strategy, options)


@pytest.mark.parametrize("schedule,options", SCHEDULES, ids=_ids)
@pytest.mark.parametrize("strategy", ["pipeline", "mpi-pipeline"])
def test_every_schedule_equivalent_to_single(comm, stack_reference, stack_config, strategy, schedule, options):
    # The suite's time: every schedule runs through both on 2 ranks of one device; on 4 ranks
    # every schedule through mpi-pipeline and the two mechanisms jax.distributed's runtime adds
    # (a split backward, a V placement) through pipeline; a second device per process places
    # stages as a 2-rank world does, so 2 ranks of 2 devices run none of them.
    if jax.local_device_count() > 1:
        pytest.skip("schedules run on one device per rank (2 and 4 ranks)")
    if comm.Get_size() > 2 and (options.get("remat") or strategy == "pipeline" and schedule not in ("zb-h1", "dualpipev")):
        pytest.skip(f"{schedule}{' with remat' if options else ''} over {strategy} runs on 2 ranks")
    _equivalent_to_single(comm, stack_reference, stack_config, strategy, {"schedule": schedule, **options})


@pytest.mark.parametrize("strategy", ["pipeline", "layer-split"])
def test_a_process_holding_one_stage_runs_its_step_as_one_program(comm, stack_config, strategy):
    """One device per process: each step is one program per process (its stage), its messages inside
    it (`host.column`, `p2p`; equal to single above); with more devices per process the host
    walks the table."""
    _on_two_ranks_only(comm, strategy)
    t = eq.run(stack_config(strategy=strategy), steps=1)
    one_each = jax.local_device_count() == 1
    assert (t.strategy.runtime.column is not None) == one_each
    assert t.strategy.describe()["step_programs"].startswith("one per device" if one_each else "per stage")
    assert sum(n for name, n in t.strategy.trace_counts.items() if name.startswith("rank_step")) == one_each


def test_bench_counts_each_process_time_blocked_in_its_messages(comm, stack_config):
    """Each process's step one program messaging the others (`p2p`): bench records every
    process's median time a step blocked in receives and flushes (the pipeline study's
    measured bubble), which the last stage spends at least waiting for its first forward and
    no process spends beyond its step."""
    if jax.local_device_count() > 1:
        pytest.skip("one device per process: the layout that runs one program each")
    from jaxpar import bench

    metrics = bench.benchmark(stack_config(strategy="pipeline", schedule="1f1b"), iters=3, warmup=1,
                              matmul_peak=False).metrics
    waited = metrics["p2p_waited_ms"]
    assert len(waited) == comm.Get_size() and 0 < waited[-1]
    assert all(0 <= w < 1.5 * metrics["step_time_ms_max"] for w in waited), (waited, metrics["step_time_ms_max"])


def test_bench_timeline_is_the_timed_steps_stamped_in_their_programs(comm, stack_config):
    """`bench --timeline` where each process runs its step as one program: the timed steps'
    own stamps, every process's: every action of the schedule once in the middle step,
    each device's actions one after another, and the bubble as lived beside its table's.
    ZBV: split backwards, two stages a device, messages within a device and across."""
    schedule = "zbv"
    if jax.local_device_count() > 1:
        pytest.skip("one device per process: the layout that runs one program each")
    from jaxpar import bench

    metrics = bench.benchmark(stack_config(strategy="pipeline", schedule=schedule), iters=3, warmup=1,
                              matmul_peak=False, timeline=True).metrics
    tl = metrics["timeline"]
    assert tl["stamped"] == "in the step's programs" and tl["one_clock"] and tl["steps"] == 3
    table = schedules.build(schedule, comm.Get_size(), stack_config(strategy="pipeline").parallel.microbatches)
    done = sorted((e["kind"], e["microbatch"], e["stage"]) for e in tl["events"] if e["kind"] != "recv")
    assert done == sorted((a.kind, a.microbatch, a.stage) for lst in table.lists for a in lst)
    for d in range(comm.Get_size()):
        mine = sorted((e["start_ms"], e["end_ms"]) for e in tl["events"] if e["device"] == d)
        assert all(end <= next_start + 1e-3 for (_, end), (next_start, _) in zip(mine, mine[1:]))
    assert 0 <= tl["idle_ms"] < metrics["step_time_ms_max"] and 0 <= tl["idle_ms_timed"] < metrics["step_time_ms_max"]
    assert len(tl["receive_ms"]) == comm.Get_size() and tl["latency_ms"] is not None


def test_when_one_process_cannot_build_the_messages_all_walk_from_the_host(comm, stack_config,
                                                                            monkeypatch):
    """The choice is made together (connecting is a collective): one process without the
    custom calls (no compiler on its host) sends every process to the host walk."""
    if jax.local_device_count() > 1:
        pytest.skip("one device per process: the layout that would run one program each")
    from jaxpar.parallel.transport import p2p

    if comm.Get_rank() == comm.Get_size() - 1:
        monkeypatch.setattr(p2p, "unavailable", lambda: "no C++ compiler (the test's)")
    t = eq.run(stack_config(strategy="pipeline"), steps=1)
    assert t.strategy.runtime.column is None
    assert f"process {comm.Get_size() - 1}: no C++ compiler (the test's)" in t.strategy.describe()["step_programs"]
    # bench's accounting of a walked schedule that splits its backward over two stages a device
    from jaxpar import bench

    metrics = bench.benchmark(stack_config(strategy="pipeline", schedule="zbv"), iters=1, warmup=0,
                              matmul_peak=False).metrics
    assert metrics["activation_bytes_per_device"] > 0 and "p2p_waited_ms" not in metrics


def test_hybrid_keeps_tensor_within_a_process(stack_config):
    """With several devices per process the default puts tensor within, stage across."""
    if jax.local_device_count() < 2:
        pytest.skip("needs 2 devices per process (JAXPAR_MPI_DEVICES=2)")
    layout = eq.run(stack_config(strategy="hybrid"), steps=1).strategy.describe()["process_layout"]
    assert layout["axes"] == {"tensor": "within", "stage": "across"}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_mpi_pipeline_bytes_bubble_and_state_per_rank(comm, stack_config, schedule):
    """Point-to-point bytes counted in each rank's compiled step equal the schedule's theory
    under both schedules; the bubble is GPipe's (1F1B's too); each rank holds its stage's
    layers and nothing of the others'."""
    _on_two_ranks_only(comm, "mpi-pipeline", schedule)
    S = comm.Get_size()
    cfg = stack_config(strategy="mpi-pipeline", optimizer="momentum", schedule=schedule)
    t = eq.run(cfg, steps=1)
    batch = t.strategy.place_batch(eq.batches(cfg.data.batch_size, 1)[0])
    acc = t.strategy.accounting(t.strategy.compile("step", t.state, batch), t.state)
    theory, p2p = acc["collective_bytes_theory"], acc["point_to_point_bytes_per_step"]
    assert p2p["sent"] == theory["point_to_point_sent"] > 0
    assert acc["collective_bytes_per_step"] == theory["total"]
    assert comm.allreduce(p2p["sent"]) == theory["pipeline_point_to_point"]
    M = cfg.parallel.microbatches
    assert acc["bubble_fraction"] == pytest.approx(acc["bubble_theory"]) == (S - 1) / (M + S - 1)
    # its share of the parameters, and of their momentum; the shares add up to the model
    mine = measure.tree_bytes(t.state.params)
    assert comm.allreduce(mine) == measure.tree_bytes(t.params)
    assert 0 <= measure.tree_bytes(t.state.opt_state) - mine <= 16
    assert 0 < mine < measure.tree_bytes(t.params)
    # the state reported is the fullest rank's, whichever rank writes the result
    mine_state = measure.tree_bytes((t.state.params, t.state.opt_state))
    assert acc["stage_state_bytes"][comm.Get_rank()] == mine_state
    assert acc["state_bytes_per_device"] == max(comm.allgather(mine_state))
    assert len(t.strategy.describe()["stage_layers"]) == S


def test_mpi_pipeline_runs_stages_of_different_shapes(comm, single):
    """The CNN cut after conv1 hands on [14, 14, 32] per example, after conv2 [7, 7, 64]:
    messages take each boundary's shape, and the run equals single."""
    S = comm.Get_size()
    if S > 3:
        pytest.skip("the CNN has 4 layers; cut at conv1 | conv2 (| fc1) for up to 3 ranks")
    cnn = lambda **o: eq.config(batch_size=16 * S, model="cnn", width=None, depth=None, lr=0.01, **o)  # noqa: E731
    ref = single(cnn(strategy="single"), 3)
    got = eq.run(cnn(strategy="mpi-pipeline", stage_boundaries=(1, 2)[:S - 1]), steps=3)
    eq.assert_equivalent(ref, got)
    assert got.strategy.describe()["boundary_shapes_per_example"] == [[14, 14, 32], [7, 7, 64]][:S - 1]


def test_cnn_split_across_processes_runs_by_permutes(comm, single):
    """The CNN's tensor split on a CPU mesh across processes runs its gathers, scatters and
    loss denominator as permutes (`comm_forms.choose`: gloo's all-gathers cost ~4 ms each)
    and equals `single` on the same global batches."""
    if jax.local_device_count() > 1:
        pytest.skip("tensor spans processes with one device per process")
    cnn = dict(model="cnn", width=None, depth=None, lr=0.02, batch_size=8 * comm.Get_size())
    ref = single(eq.config(strategy="single", **cnn), 3)
    got = eq.run(eq.config(strategy="tensor", **cnn), steps=3)
    assert got.strategy.describe()["collective_form"] == "permute"
    eq.assert_equivalent(ref, got)


def test_mpi_pipeline_cuts_the_cnn_inside_conv2_and_runs_the_table_in_order(comm, single):
    """Without --stage-boundaries the CNN is cut inside conv2 (`finer`: whole layers leave
    ~85% of the work on one rank) and equals `single`. Each rank's compiled step keeps the
    table's order: a message between every two of its stage computations (left to itself
    XLA ran rank 0's forwards all before its first send, and 2 ranks were no faster than 1)."""
    S = comm.Get_size()
    cnn = lambda **o: eq.config(batch_size=16 * S, model="cnn", width=None, depth=None, lr=0.01, **o)  # noqa: E731
    ref = single(cnn(strategy="single"), 3)
    got = eq.run(cnn(strategy="mpi-pipeline", microbatches=4), steps=3)
    assert got.strategy.describe()["cut_inside"] is not None
    eq.assert_equivalent(ref, got)
    batch = got.strategy.place_batch(eq.batches(16 * S, 1)[0])
    text = jax.jit(got.strategy._step).lower(got.state, batch).compile().as_text()
    entry = text[text.index("\nENTRY"):]
    order = [("conv" if " convolution(" in line else "msg") for line in entry.splitlines()
             if " convolution(" in line or "mpi_sendrecv" in line]
    convs_before_first_message = order.index("msg")
    assert convs_before_first_message <= 3, order  # rank 0: one micro-batch's forward at most
