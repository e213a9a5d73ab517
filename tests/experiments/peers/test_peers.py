"""The PyTorch peer: twins equal jaxpar's models weight for weight, both sides run the same
optimizer, the quick study records every configuration with consistent ratios and resumes
(reusing its points, measuring damaged ones again, refusing those of other settings), and
without torch the command exits 2 and writes nothing.
Speed is the benchmark's business (`python -m experiments peers`), not the tests'.

    python -m pytest -q tests/experiments/peers/test_peers.py
"""

import dataclasses
import functools
import json
import sys

import jax
import numpy as np
import pytest

from experiments.peers import study as peers
from experiments.peers import rows as peers_rows
from experiments.peers import tables as peers_tables
from experiments.__main__ import EXIT_USAGE, run
from experiments.peers.torch_point import TorchPoint
from jaxpar import data as datalib
from jaxpar import step as steplib
from jaxpar.models import make_model, param_count
from jaxpar.parallel import STRATEGIES

NO_TORCH = "needs the `peer` extra (torch==2.13.0): pip install '.[peer]' or make peer"
GRAD_TOLERANCE = 1e-5  # per-leaf ||delta|| / ||reference||, DESIGN.md's equivalence measure
# PyTorch's own float32 CPU backward for the ResNet: one ReLU of 200,704 that float32 rounding
# puts on the other side of zero (float64 keeps it) moves the stem's and first block's
# gradients by ~2e-3; jaxpar's float32 agrees with float64 to ~2e-6 on the same weights.
F32_TOLERANCE = {"mlp": GRAD_TOLERANCE, "cnn": GRAD_TOLERANCE, "resnet": 1e-2}


@functools.cache
def _jaxpar_step(name: str):
    """jaxpar's float32 params, loss and gradients of model `name` on a batch of 16."""
    images, labels = datalib.synthetic(16, seed=0)
    batch = {"image": images, "label": labels, "weight": np.ones(16, np.float32)}
    graphdef, params, model_state = steplib.split_model(make_model(name, seed=0))
    loss_and_grad = jax.jit(jax.value_and_grad(steplib.loss_fn, has_aux=True), static_argnums=1)
    (loss, _), grads = loss_and_grad(params, graphdef, model_state, batch)
    return batch, params, float(loss), jax.tree.map(np.asarray, grads)


def _twin_step(name: str, dtype):
    """jaxpar's loss and gradients (float32) and its twin's (in `dtype`), same weights, same batch,
    the twin's gradients mapped back into jaxpar's layout."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    from torch.nn import functional as F

    from experiments.peers import torch_models

    batch, params, loss, grads = _jaxpar_step(name)
    twin = torch_models.make_twin(name)
    assert torch_models.param_count(twin) == param_count(make_model(name, seed=0))
    names = torch_models.load_jax_params(twin, params)
    twin = twin.to(dtype).train()
    twin_loss = F.cross_entropy(twin(torch_models.images(batch["image"]).to(dtype) / 255.0),
                                torch.from_numpy(batch["label"].astype(np.int64)))
    twin_loss.backward()
    by_name = dict(twin.named_parameters())
    twin_grads = {path: torch_models.from_torch_layout(twin, path, by_name[n].grad.double().numpy())
                  for path, n in names.items()}
    return loss, twin_loss.item(), torch_models.flat_params(grads), twin_grads


def _worst(ours: dict, theirs: dict) -> tuple[float, str]:
    """The largest per-leaf relative difference and its leaf."""
    assert set(ours) == set(theirs)
    return max((np.linalg.norm(theirs[k] - ours[k]) / np.linalg.norm(ours[k]), k) for k in ours)


@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet"])
def test_twin_is_jaxpars_model_in_pytorch(name):
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    # float64 on PyTorch's side: the twin's structure, free of float32 rounding at ReLU kinks
    loss, twin_loss, grads, twin_grads = _twin_step(name, torch.float64)
    assert twin_loss == pytest.approx(loss, rel=1e-6)
    worst, leaf = _worst(grads, twin_grads)
    assert worst <= GRAD_TOLERANCE, f"{name} {leaf}: relative gradient difference {worst:.2e}"
    # and as the benchmark runs it, float32 on both sides
    loss, twin_loss, grads, twin_grads = _twin_step(name, torch.float32)
    assert twin_loss == pytest.approx(loss, rel=1e-5)
    worst, leaf = _worst(grads, twin_grads)
    assert worst <= F32_TOLERANCE[name], f"{name} {leaf}: relative gradient difference {worst:.2e}"


def test_twin_refuses_weights_of_another_model():
    pytest.importorskip("torch", reason=NO_TORCH)
    from experiments.peers import torch_models

    _, params, _ = steplib.split_model(make_model("mlp", seed=0, width=256))
    with pytest.raises(ValueError, match="does not fit"):
        torch_models.load_jax_params(torch_models.make_twin("mlp"), params)


def test_both_sides_run_the_same_optimizer_on_the_same_batch():
    config = peers.QUICK
    for key, _, _ in peers.CONFIGS:
        p = peers.round_point(config, "mlp", key, 1, ("dp-auto", 2, 1))
        assert p.folder == f"points/mlp/{key}/r1"  # each round its own folder
        if isinstance(p, TorchPoint):
            assert (p.lr, p.batch_size, p.iters, p.warmup) == (config.lr, config.batch_size, config.iters,
                                                               config.warmup)
        else:
            optim = p.config.optim
            assert (optim.optimizer, optim.lr, optim.lr_schedule) == ("adam", config.lr, "constant")
            assert (p.config.data.batch_size, p.bench.iters, p.bench.warmup) == (
                config.batch_size, config.iters, config.warmup)
            assert p.config.model.conv_impl is None  # the model's default: the fast CPU layers
    chained = peers.round_point(config, "mlp", "jaxpar-best", 1, ("single", 1, 4))
    assert chained.config.parallel.steps_per_dispatch == 4  # as many calls, of 4 steps each
    assert chained.bench.iters == config.iters


def test_the_screening_is_single_and_the_data_parallel_family():
    pytest.importorskip("torch", reason=NO_TORCH)
    found = peers.resolved_plan(dataclasses.replace(peers.PeersConfig(), best_devices=(1, 2, 4)))
    family = [n for n, c in STRATEGIES.items() if c.family == "data parallel"]
    assert found.candidates[:2] == (("single", 1, 1), ("single", 1, 4))
    chains = {s for s in family if "steps_per_dispatch" in STRATEGIES[s].options}
    assert "dp-pmap" in set(family) - chains  # a pmapped step is screened one step per call
    assert sorted(found.candidates[2:]) == sorted((s, n, k) for s in family for n in (2, 4)
                                                  for k in (1, 4) if k == 1 or s in chains)


@pytest.mark.parametrize("pick_ms, best_ms, named", [(53.9, 50.3, "single on 1 device(s)"),
                                                      (48.0, 48.0, "local-sgd on 2 device(s)")])
def test_best_row_is_the_faster_of_the_pick_and_single_in_the_rounds(pick_ms, best_ms, named):
    def record(ms):
        return {"ms": ms, "processes": 1, "threads": 2, "first_step_s": 1.0,
                "peak_gflops": 100.0, "flops_per_step": 1e9}

    rounds = {"resnet": {"jaxpar-single": [record(50.3)], "jaxpar-best": [record(pick_ms)],
                         "torch-eager": [record(66.7)]}}
    screened = {"resnet": {"strategy": "local-sgd", "devices": 2, "steps_per_dispatch": 4}}
    labels = {key: (framework, what) for key, framework, what in peers.CONFIGS}
    config = peers.PeersConfig()
    rows = {r["config"]: r for r in peers_rows.peer_rows(config, rounds, screened, labels)}
    best = rows["jaxpar-best"]
    assert best["ms_per_step"] == best_ms and named in best["what"]
    assert best["ratio_vs_peer"] == pytest.approx(66.7 / best_ms)
    assert best.get("screened_pick_ms_per_step", pick_ms) == pick_ms
    if best_ms != pick_ms:  # the pick's own time is said beside the table
        data = {"config": {**dataclasses.asdict(config), "screen_iters": 10},
                "env": {"cpu_cores": 2, "jax": jax.__version__}, "metrics": {"rows": list(rows.values()),
                                                     "param_counts": {}, "best": screened,
                                                     "skipped": {}, "failed": {}}}
        screened["resnet"]["candidates"] = []
        assert "resnet: local-sgd on 2 device(s), 4 steps per dispatch, 53.90 ms/step" in (
            peers_tables.peers_summary(data))
    assert rows["jaxpar-single"]["ms_per_step"] == 50.3


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    pytest.importorskip("torch", reason=NO_TORCH)
    out = tmp_path_factory.mktemp("peers")
    assert run(["peers", "--quick", "--out", str(out)]) == 0
    return out, json.loads((out / "peers.json").read_text())


def test_quick_study_runs_every_configuration_in_one_run(quick):
    out, data = quick
    m, env = data["metrics"], data["env"]
    rows = {r["config"]: r for r in m["rows"]}
    expected = {key for key, _, _ in peers.CONFIGS} - set(m["skipped"])
    assert set(rows) | {k.split(" ", 1)[1] for k in m["failed"]} == expected
    assert set(m["skipped"]) <= {"jaxpar-ranks"}  # only MPI may be absent
    assert all(why for why in m["skipped"].values())
    assert env["torch"].startswith("2.13.0") and env["torch_compile"]
    count = m["param_counts"]["mlp"]
    assert count == param_count(make_model("mlp", seed=0))
    for key, r in rows.items():
        assert len(r["rounds_ms"]) == data["config"]["rounds"]
        assert r["images_per_sec"] == pytest.approx(data["config"]["batch_size"] / r["ms_per_step"] * 1000)
        if r["peer"] is not None:
            assert r["ratio_vs_peer"] == pytest.approx(r["images_per_sec"] / rows[r["peer"]]["images_per_sec"])
        # one FLOP count per step for every configuration: achieved GFLOP/s are comparable
        assert r["achieved_gflops"] == pytest.approx(r["flops_per_step"] / r["ms_per_step"] / 1e6)
    assert rows["jaxpar-single"]["peer"] in ("torch-eager", "torch-compile")
    assert rows["jaxpar-single"]["peak_gflops"] > 0 and rows["torch-eager"]["peak_gflops"] > 0
    assert (rows["torch-ddp"]["processes"], rows["torch-ddp"]["threads_per_process"]) == (2, 1)
    assert rows["torch-eager"]["threads_per_process"] == env["cores_available"]
    if "jaxpar-ranks" in rows:
        mpi = rows["jaxpar-ranks"]
        assert (mpi["processes"], mpi["threads_per_process"], mpi["peer"]) == (2, 1, "torch-ddp")
    best = m["best"]["mlp"]
    assert {1, 2} == {c["steps_per_dispatch"] for c in best["candidates"]}
    assert (best["strategy"], best["devices"], best["steps_per_dispatch"]) in {
        (c["strategy"], c["devices"], c["steps_per_dispatch"]) for c in best["candidates"]}
    table = (out / "summary.md").read_text()
    assert f"{rows['jaxpar-single']['ratio_vs_peer']:.2f} (" in table and f"mlp {count:,}" in table
    assert (out / "peers.png").stat().st_size > 10_000


def _point_files(out):
    return {p: p.stat().st_mtime_ns for d in ("points", "screen") for p in (out / d).rglob("*.json")}


def test_quick_study_resumes_without_rerunning_points(quick):
    out, _ = quick
    before = _point_files(out)
    assert run(["peers", "--quick", "--out", str(out)]) == 0
    assert _point_files(out) == before


@pytest.mark.parametrize("flags,folder", [(["--adam", "foreach"], "points/mlp/torch-eager/r0"),
                                          (["--lr", "0.001"], "screen/mlp/single-1")])
def test_points_of_other_settings_are_refused_before_any_work(quick, capsys, flags, folder):
    out, _ = quick
    before = _point_files(out)
    assert run(["peers", "--quick", *flags, "--out", str(out)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"{out / folder} holds a point measured with other settings" in err
    assert _point_files(out) == before


def test_damaged_points_are_measured_again(quick):
    out, _ = quick
    damaged = [out / "points/mlp/torch-eager/r0/torch.json", out / "points/mlp/jaxpar-single/r0/result.json"]
    for path in damaged:
        path.write_text(path.read_text()[:50])  # a killed run's half file
    before = _point_files(out)
    assert run(["peers", "--quick", "--out", str(out)]) == 0
    after = _point_files(out)
    changed = {p for p in before if after[p] != before[p]}
    assert set(damaged) <= changed and all(p.parent in {d.parent for d in damaged} for p in changed)
    assert all(json.loads(p.read_text()) for p in damaged)


def test_without_torch_exits_2_naming_the_install_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch fails; find_spec says None
    out = tmp_path / "never"
    assert run(["peers", "--quick", "--out", str(out)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "pip install '.[peer]'" in err and "torch==2.13.0" in err
    assert not out.exists()


@pytest.mark.parametrize("flags,needle", [
    (["--models", "mlp,vit"], "vit: no PyTorch twin"),
    (["--rank-strategy", "single"], "--rank-strategy single does not run across processes"),
    (["--best-strategies", "tensor"], "--best-strategies tensor: choose data-parallel strategies"),
    (["--ranks", "3"], "--batch-size 128 must be a multiple of --ranks 3"),
    (["--sections", "pipelines"], "--sections pipelines: choose one or both of data-parallel, model-parallel"),
    (["--microbatches", "7"], "--microbatches 7 must divide --batch-size 128"),
    (["--mp-model", "resnet"], "--mp-model resnet: choose a model whose PyTorch twin is cut into stages"),
    (["--mp-configs", "torch-zb"], "--mp-configs torch-zb: choose from torch-gpipe"),
    (["--schedules", "zb"], "--schedules zb: choose from gpipe, 1f1b"),
])
def test_bad_options_exit_2_before_any_work(tmp_path, capsys, flags, needle):
    pytest.importorskip("torch", reason=NO_TORCH)
    out = tmp_path / "never"
    assert run(["peers", *flags, "--out", str(out)]) == EXIT_USAGE
    assert needle in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_twin_layers_are_jaxpars_layers_and_its_stages_are_its_forward(name):
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    from experiments.peers import torch_models
    from jaxpar.config import ModelConfig
    from jaxpar.parallel.pipeline import partition

    twin = torch_models.make_twin(name)
    assert [n for n, _ in torch_models.layers(twin)] == partition.layer_names(ModelConfig(model=name))
    images = torch_models.images(datalib.synthetic(4, seed=0)[0])
    starts = (0, len(torch_models.layers(twin)) - 1)
    staged = torch_models.stage(twin, starts, 1)(torch_models.stage(twin, starts, 0)(images))
    torch.testing.assert_close(staged, twin(images.float() / 255.0))


def test_the_twin_cut_inside_conv2_is_its_forward_and_jaxpars_layers():
    """The CNN twin with conv2 as two layers (where jaxpar's pipelines cut it): jaxpar's layer
    names, and its stages cut between the parts are the twin's forward; the gradient of the
    loss reaches conv2's whole kernel (both parts' slices)."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    from experiments.peers import torch_models
    from jaxpar.models.cnn import CNN, CNNCut
    from flax import nnx

    twin = torch_models.make_twin("cnn")
    names = [n for n, _ in torch_models.layers(twin, 24)]
    assert names == [layer.name for layer in CNNCut(CNN(rngs=nnx.Rngs(0)), 24, (28, 28, 1)).layers()]
    images = torch_models.images(datalib.synthetic(4, seed=0)[0])
    stages = [torch_models.stage(twin, (0, 2), i, channels=24) for i in range(2)]
    staged = stages[1](stages[0](images))
    torch.testing.assert_close(staged, twin(images.float() / 255.0))
    staged.square().sum().backward()
    grad = twin.conv2.weight.grad
    assert grad is not None and bool((grad[:24].abs().sum() > 0) & (grad[24:].abs().sum() > 0))


def test_pytorch_pipelines_cut_where_jaxpar_cuts_with_the_same_micro_batches():
    pytest.importorskip("torch", reason=NO_TORCH)
    from experiments.peers import model_parallel as peers_mp
    from jaxpar.parallel.pipeline import inner_cut as finer

    config = dataclasses.replace(peers.PeersConfig(), rounds=1)  # the CNN, M=8, 2 ranks
    for schedule in ("gpipe", "1f1b"):
        theirs = peers_mp.mp_point(config, f"torch-{schedule}", 0)
        for where in ("mpi-pipeline", "pipeline-ranks", "pipeline-devices"):
            ours = peers_mp.mp_point(config, f"jaxpar-{where}-{schedule}", 0)
            p = ours.config.parallel
            assert (p.microbatches, p.schedule) == (theirs.microbatches, schedule) == (8, schedule)
            cut = finer.plan(ours.config, 2, inside=True)  # conv1, conv2[:k] | conv2[k:], fc1, fc2
            assert (theirs.stage_starts, theirs.cut_channels) == (cut.starts, cut.channels) == ((0, 2), 32)
            # one pinned thread per rank, or per simulated device in one process
            assert (ours.ranks, p.single_thread) == ((2, True) if "ranks" in where or "mpi" in where
                                                     else (None, True))
        assert (theirs.mode, theirs.ranks, theirs.batch_size) == (schedule, 2, config.batch_size)


def test_quick_study_runs_pytorchs_pipelines_beside_jaxpars(quick):
    out, data = quick
    mp = data["metrics"]["model_parallel"]
    rows = {r["config"]: r for r in mp["rows"]}
    assert {"torch-gpipe", "torch-1f1b"} <= set(rows)
    for r in rows.values():
        assert r["ms_per_step"] > 0 and len(r["rounds_ms"]) == 1
        assert (r["processes"], r["threads_per_process"]) == (2, 1)
        assert r["stage_starts"] == mp["config"]["stage_starts"]  # jaxpar's own record of its cut, too
    if "jaxpar-mpi-pipeline-gpipe" in rows:  # absent only where MPI is not installed
        ours = rows["jaxpar-mpi-pipeline-gpipe"]
        assert ours["peer"] == "torch-gpipe"
        assert ours["ratio_vs_peer"] == pytest.approx(ours["images_per_sec"] / rows["torch-gpipe"]["images_per_sec"])
    else:
        assert "jaxpar-mpi-pipeline-gpipe" in mp["skipped"]
    assert "Model parallelism: mlp on 2 ranks" in (out / "summary.md").read_text()


def test_one_section_alone_keeps_the_others_rows(quick):
    out, _ = quick
    data = json.loads((out / "peers.json").read_text())
    before = _point_files(out)
    assert run(["peers", "--quick", "--sections", "model-parallel", "--out", str(out)]) == 0
    again = json.loads((out / "peers.json").read_text())
    assert again["metrics"]["rows"] == data["metrics"]["rows"]  # the data-parallel section, kept
    assert again["metrics"]["model_parallel"]["rows"] == data["metrics"]["model_parallel"]["rows"]
    assert _point_files(out) == before  # every model-parallel point reused
