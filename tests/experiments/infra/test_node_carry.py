"""A lent node's run needs nothing from the network (experiments/infra/node_carry.py,
experiments/infra/measure_node.sh): it refuses, before measuring or writing anything, when the carry
is missing or `--conv-impl auto` would not resolve to oneDNN on the CPU; the prepared carry and
the tree fit the 64 MiB a device call takes; oneDNN's library wheel is carried with one copy.

    python -m pytest -q tests/experiments/infra/test_node_carry.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest

from conftest import ROOT
from experiments.infra import node_carry


def node_carry_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.infra.node_carry", *args], cwd=ROOT,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=300)


def test_an_empty_carry_is_refused_naming_prepare(tmp_path):
    with pytest.raises(node_carry.CarryError, match="node_carry prepare"):
        node_carry.install_carry(tmp_path)
    done = node_carry_cli("install", "--carry", str(tmp_path))
    assert done.returncode == 2 and "node_carry prepare" in done.stderr


def test_the_script_refuses_an_empty_carry_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(["bash", "experiments/infra/measure_node.sh", "node", "1", "1", str(out)],
                          cwd=ROOT, env={**os.environ, "CARRY": str(tmp_path / "carry"),
                                         "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "node_carry prepare" in done.stderr and not out.exists()
    assert "gpu run" not in done.stdout  # nothing was measured


def test_the_check_refuses_a_cpu_where_onednn_cannot_run(tmp_path):
    # No built custom calls in an empty cache, and a compiler that fails: oneDNN is
    # unavailable, so "auto" resolves to the "cpu" forms, as on a node without the carry.
    done = node_carry_cli("check", env={"JAXPAR_CACHE": str(tmp_path), "CXX": "false"})
    assert done.returncode == 2, done.stdout + done.stderr[-2000:]
    assert "resolves to 'cpu' on this CPU, not oneDNN" in done.stderr
    assert "node_carry prepare" in done.stderr and "C++ compiler" in done.stderr
    assert not any(tmp_path.iterdir())  # nothing built, nothing written


def test_the_check_passes_where_onednn_runs():
    from jaxpar.models import onednn

    if onednn.unavailable():
        pytest.skip(f"oneDNN does not run here ({onednn.unavailable()})")
    done = node_carry_cli("check")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resolves to onednn on this CPU: oneDNN " in done.stdout


def test_the_library_wheel_keeps_one_copy_as_upstream_hashed_it(tmp_path):
    wheel = tmp_path / "onednn_cpu_gomp-1-py3-none-any.whl"
    lib = "onednn_cpu_gomp-1.data/data/lib/"
    record = "".join(f"{lib}{n},sha256=x,3\n" for n in ("libdnnl.so", "libdnnl.so.3", "libdnnl.so.3.2"))
    with zipfile.ZipFile(wheel, "w") as z:
        for n in ("libdnnl.so", "libdnnl.so.3", "libdnnl.so.3.2"):
            z.writestr(lib + n, b"elf")
        z.writestr("onednn_cpu_gomp-1.dist-info/RECORD", record + "onednn_cpu_gomp-1.dist-info/RECORD,,\n")
    done = node_carry.trim_library_wheel(wheel)
    assert done["dropped"] == ["libdnnl.so", "libdnnl.so.3.2"]
    with zipfile.ZipFile(wheel) as z:
        assert [n for n in z.namelist() if "/lib/" in n] == [lib + "libdnnl.so.3"]
        kept = z.read("onednn_cpu_gomp-1.dist-info/RECORD").decode().splitlines()
    assert kept == [f"{lib}libdnnl.so.3,sha256=x,3", "onednn_cpu_gomp-1.dist-info/RECORD,,"]


def test_the_prepared_carry_and_the_tree_fit_one_device_call():
    carry = ROOT / node_carry.CARRY
    if not (carry / node_carry.MANIFEST).is_file():
        pytest.skip(f"{node_carry.CARRY} is not prepared here (`python -m experiments.infra.node_carry "
                    "prepare` downloads it; it is ignored by git)")
    manifest = node_carry.read_manifest(carry)  # every file present, as hashed when prepared
    assert any(n.startswith("onednn/onednn_cpu_gomp") for n in manifest["files"])
    tree, carried = node_carry.size(carry, ROOT)
    assert tree + carried <= node_carry.LIMIT_BYTES, (
        f"tree {tree / 2**20:.1f} MiB + carry {carried / 2**20:.1f} MiB is over "
        f"{node_carry.LIMIT_BYTES / 2**20:.0f} MiB")
    assert json.loads((carry / node_carry.MANIFEST).read_text())["trimmed"]["kept"] == "libdnnl.so.3"
