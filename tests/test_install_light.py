"""jaxpar runs where JAX is already installed: from a checkout, `pip install --no-deps -e .` on
top of jax, jaxlib, flax, optax, numpy and rich alone (no TFDS, array_record, orbax,
matplotlib, gradio, mpi4py, mpi4jax or torch), `import jaxpar`, `bench` and the machine
command's quick form run, and a command that needs a missing package names its install.

A real venv (not --system-site-packages: the test venv's own packages would leak in), built
once for the module. The packages come from wherever this pip gets them (its cache, a local
index, PyPI), pinned to the versions running the tests; flax without its dependencies, but
the four it imports (its others, orbax-checkpoint and tensorstore, are what jaxpar must not
need). pip runs from the test venv (`pip --python`): the new venv needs no pip of its own.

    python -m pytest -q tests/test_install_light.py
"""

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

CORE = ("jax", "jaxlib", "optax", "numpy", "rich")
# What flax imports (its metadata lists orbax-checkpoint and tensorstore too, which it does not).
FLAX_IMPORTS = ("msgpack", "pyyaml", "treescope", "typing_extensions")
ABSENT = ("tensorflow_datasets", "array_record", "orbax", "matplotlib", "gradio", "mpi4py",
          "mpi4jax", "torch")
PIP_TIMEOUT_S = 300


def pinned(names) -> list[str]:
    return [f"{n}=={importlib.metadata.version(n)}" for n in names]


def pip(python: str, *args: str) -> None:
    """pip install ARGS into `python`'s venv; skips the module when the packages cannot be had
    at all (offline, no cache), fails on any other error."""
    done = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q",
                           "--no-compile", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=PIP_TIMEOUT_S, cwd=ROOT)
    if done.returncode and ("No matching distribution" in done.stderr
                            or "Could not find a version" in done.stderr):
        pytest.skip(f"pip cannot get the packages here (offline, no cache): {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def light(tmp_path_factory):
    """The venv's python: jax, jaxlib, flax, optax, numpy, rich, and jaxpar from this checkout."""
    venv = tmp_path_factory.mktemp("light") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = str(venv / "bin" / "python")
    # setuptools: pyproject.toml's build backend, for the editable install without isolation.
    pip(python, *pinned(CORE + FLAX_IMPORTS), "setuptools>=68")
    pip(python, "--no-deps", *pinned(("flax",)))
    pip(python, "--no-deps", "--no-build-isolation", "-e", str(ROOT))
    return python


def run_in(python: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`python ARGS` from a folder outside the checkout (the editable install, not the cwd),
    with none of this process's paths or device settings."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    return subprocess.run([python, *args], capture_output=True, text=True, timeout=timeout,
                          env={**env, "PYTHONUNBUFFERED": "1"}, cwd="/")


def test_jaxpar_imports_alone_and_a_command_needing_more_names_its_install(light, tmp_path):
    cases = ((["figures", "--data", str(ROOT / "figures" / "data"), "--out", str(tmp_path)],
              "optional dependency matplotlib needed for figures"),
             (["train", "--dataset", "fashion_mnist", "--steps", "1"],
              "optional dependency tensorflow_datasets needed for real data sets"),
             (["train", "--model", "mlp", "--width", "16", "--depth", "1", "--steps", "1",
               "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "run")],
              "pip install orbax-checkpoint"))
    # One process (each start imports JAX): the imports, then each command's exit status.
    script = ("import importlib.util, json, sys, jaxpar, jaxpar.train, jaxpar.bench\n"
              "from experiments.__main__ import run\n"
              f"codes = [run(args) for args in {[args for args, _ in cases]!r}]\n"
              f"present = [m for m in {ABSENT!r} if importlib.util.find_spec(m)]\n"
              "print(json.dumps([jaxpar.__file__, present, codes]))\n")
    done = run_in(light, "-c", script)
    assert done.returncode == 0, done.stderr[-3000:]
    where, present, codes = json.loads(done.stdout.splitlines()[-1])
    assert where.startswith(str(ROOT)) and present == []
    assert codes == [2] * len(cases), done.stderr[-3000:]
    for _, needle in cases:
        assert needle in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()  # nothing half-written


def test_bench_and_the_machine_command_run(light, tmp_path):
    done = run_in(light, "-m", "experiments", "bench", "--model", "mlp", "--width", "64",
                  "--depth", "1", "--batch-size", "32", "--iters", "2", "--warmup", "1",
                  "--no-matmul-peak", "--out", str(tmp_path / "bench"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "bench" / "result.json").read_text())["metrics"]["images_per_sec"] > 0
    done = run_in(light, "-m", "experiments", "machine", "--quick", "--out", str(tmp_path / "machine"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    study = json.loads((tmp_path / "machine" / "machine.json").read_text())
    parts = {(r["part"], r["workers"]) for r in study["metrics"]["rows"]}
    assert {("one-device", 1), ("devices", 1), ("devices", 2)} <= parts
    skipped = study["metrics"]["skipped"]
    assert "optional dependency torch" in skipped["torch"] and "mpi4jax" in skipped["ranks"]
