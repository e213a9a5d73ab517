"""The demo command without a browser: the missing extra and a port in use get a clear
message, the page builds and serves with bad folders to load, figure captions come from the
documents that show the figures.

    python -m pytest -q tests/experiments/demo/test_demo_app.py
"""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request

import pytest

import experiments.demo as demo
from conftest import ROOT
from demo_server import demo_server, skip_without_gradio
from experiments.demo import captions
from experiments.demo.models import BUNDLED
from jaxpar.errors import ConfigError
from jaxpar.results import RESULT_FILE
from jaxpar.results import load as load_result


def test_without_the_extra_the_command_names_the_install():
    code = ("import sys; sys.modules['gradio'] = None  # as if not installed\n"
            "from experiments.__main__ import run; sys.exit(run(['demo']))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert "pip install -e '.[demo]'" in out.stderr and "Traceback" not in out.stderr


def listening(port: int = 0) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_a_port_in_use_moves_to_the_next_free_one(monkeypatch):
    with listening() as busy:
        port = busy.getsockname()[1]
        assert demo.free_port("127.0.0.1", port) > port
        monkeypatch.setattr(demo, "PORTS_TRIED", 1)
        with pytest.raises(ConfigError, match="in use.*--port"):
            demo.free_port("127.0.0.1", port)


def test_captions_come_from_the_documents(tmp_path):
    (tmp_path / "figures").mkdir()
    for name in ("a.png", "b.png", "c.png", captions.SCREENSHOT):
        (tmp_path / "figures" / name).write_bytes(b"")
    (tmp_path / "README.md").write_text(
        "# x\n\n![the b figure](figures/b.png)\n\n*figures/b.png* — what b shows,\nover two lines.\n\n"
        "![a](figures/a.png)\n\nNot a caption.\n")
    found = captions.figures(tmp_path)
    assert [f.path.name for f in found] == ["b.png", "a.png", "c.png"]  # the document's order
    assert found[0].caption == "what b shows, over two lines." and found[0].source == "README.md"
    assert found[1].caption == "a"      # no caption paragraph: its alt text
    assert found[2].caption == "c.png"  # shown nowhere: its name
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "studies.md").write_text(
        "![c](../figures/c.png)\n\n*figures/c.png* - c, from the studies page.\n")
    found = captions.figures(tmp_path)
    assert found[0].path.name == "c.png" and found[0].caption == "c, from the studies page."
    assert found[0].source == "docs/studies.md"
    (tmp_path / "docs" / "studies").mkdir()
    (tmp_path / "docs" / "studies" / "one.md").write_text(
        "![a](../../figures/a.png)\n\n*figures/a.png* — a, from a study's page.\n")
    (tmp_path / "docs" / "studies.md").write_text("| [one](studies/one.md) |\n")
    found = captions.figures(tmp_path)  # the index's pages first, in its order, then the README
    assert [(f.path.name, f.source) for f in found] == [
        ("a.png", "docs/studies/one.md"), ("b.png", "README.md"), ("c.png", "")]
    assert found[0].caption == "a, from a study's page."


def test_every_committed_figure_has_a_caption():
    for figure in captions.figures():
        assert figure.source, f"{figure.path.name} is shown in no document ({captions.caption_documents()})"
        assert len(figure.caption) > 40, figure.path.name


def test_the_demo_serves_beside_a_busy_port_with_bad_folders_to_load(tmp_path):
    skip_without_gradio()
    with listening() as busy:
        port = busy.getsockname()[1]
        with demo_server(tmp_path, "--port", str(port), "--dataset", "synthetic",
                         "--load", f"{tmp_path},{tmp_path / 'nowhere'}") as server:
            assert f"port {port} on 127.0.0.1 is in use; serving on" in server.output
            assert not server.url.endswith(f":{port}/")
            page = urllib.request.urlopen(server.url, timeout=30).read().decode()
            assert "jaxpar demo" in page
            config = urllib.request.urlopen(server.url + "config", timeout=30).read().decode()
            assert "could not load" in config and "holds no jaxpar result" in config
            assert "is not a folder" in config


def test_the_committed_models_accuracies_as_the_page_quotes_them():
    """docs/demo.md quotes each committed model's test accuracy: its result.json's."""
    doc = (ROOT / "docs" / "demo.md").read_text()
    folders = sorted(p.parent for p in BUNDLED.glob(f"*/{RESULT_FILE}"))
    assert [f.name for f in folders] == ["fashion-cnn", "fashion-mlp"]
    for folder in folders:
        accuracy = load_result(folder / RESULT_FILE).metrics["test_accuracy"]
        assert f"figures/data/demo/{folder.name}`" in doc and f"{accuracy:.2%} test accuracy" in doc
