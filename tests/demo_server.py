"""A `python -m experiments demo` process for tests: started, waited for, stopped.

    with demo_server(tmp_path, "--dataset", "synthetic") as server:
        urllib.request.urlopen(server.url)
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest

from conftest import ROOT

START_TIMEOUT_S = 180  # Gradio, JAX and the committed model load first (shared CPUs: slow)


@dataclass
class Server:
    proc: subprocess.Popen
    url: str = ""
    lines: list[str] = field(default_factory=list)

    @property
    def output(self) -> str:
        return "".join(self.lines)


def skip_without_gradio() -> None:
    pytest.importorskip("gradio", reason="the demo extra is not installed: pip install -e '.[demo]'")


@contextlib.contextmanager
def demo_server(tmp_path, *args: str):
    """Start the demo (runs under tmp_path), yield once it serves, stop it (Ctrl-C) after."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "experiments", "demo", "--runs-dir", str(tmp_path / "runs"), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    server = Server(proc)

    def read():
        for line in proc.stdout:
            server.lines.append(line)
            found = re.search(r"Running on local URL:\s+(\S+)", line)
            if found:
                server.url = found.group(1).rstrip("/") + "/"

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while not server.url:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the demo did not start (status {proc.poll()}):\n{server.output[-3000:]}")
            time.sleep(0.2)
        yield server
    finally:
        proc.send_signal(signal.SIGINT)  # as a person stops it; live runs get their checkpoint
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
