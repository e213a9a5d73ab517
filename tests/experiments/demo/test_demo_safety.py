"""The demo safe to share: beyond loopback it needs a password or refuses to start; one
request may start only so much (steps, devices, batch, runs at once), each excess refused with
its message and nothing started; Classify reads only its own folders. Checked on the bounds
themselves, on the command line, and through the page's API with gradio_client, as any
machine that reaches the port could call it.

    python -m pytest -q tests/experiments/demo/test_demo_safety.py
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT
from demo_server import demo_server, skip_without_gradio
from experiments.demo import live
from experiments.demo.safety import (PASSWORD_ENV, Limits, RequestError, auth_for, is_loopback,
                                     password_from)
from jaxpar.data import DATASETS
from jaxpar.errors import ConfigError
from jaxpar.models import MODELS

PASSWORD = "correct horse"
OK = dict(model="mlp", dataset="synthetic", strategies=["single", "dp-shard-map"], devices=2,
          steps=400, batch=128, eval_every=50)


def check(limits: Limits = Limits(), **changes):
    request = {**OK, **changes}
    return limits.check(*request.values(), models=list(MODELS), datasets=list(DATASETS),
                        strategies_for=live.strategies_for)


def test_loopback_addresses():
    for host in ("127.0.0.1", "127.3.2.1", "localhost", "::1", "[::1]"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "192.168.1.20", "10.0.0.1", "example.org", ""):
        assert not is_loopback(host), host


def test_beyond_loopback_a_password_or_no_start(monkeypatch):
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    assert auth_for("127.0.0.1", None) is None  # this machine only: no login
    for host in ("0.0.0.0", "::", "192.168.1.20"):
        with pytest.raises(ConfigError, match=f"--host {host} lets other machines in.*{PASSWORD_ENV}"):
            auth_for(host, password_from(None))
    login = auth_for("0.0.0.0", PASSWORD)
    assert login("anyone", PASSWORD) and not login("anyone", "wrong") and not login("anyone", "")
    monkeypatch.setenv(PASSWORD_ENV, "from the environment")
    assert password_from(None) == "from the environment" and password_from("option") == "option"
    monkeypatch.setenv(PASSWORD_ENV, " ")
    with pytest.raises(ConfigError, match="password is empty"):
        password_from(None)


def test_each_bound_has_its_message():
    assert check() == {"model": "mlp", "dataset": "synthetic", "strategies": ("single", "dp-shard-map"),
                       "devices": 2, "steps": 400, "batch_size": 128, "eval_every": 50}
    small = Limits(max_steps=100, max_devices=2, max_batch=64, max_runs=1)
    for changes, message in [
            (dict(steps=10**9), "steps 1000000000 is over this demo's bound of 5000.*--max-steps"),
            (dict(devices=4096), "simulated devices 4096 is over this demo's bound of 8.*--max-devices"),
            (dict(batch=10**6), "global batch 1000000 is over this demo's bound of 1024.*--max-batch"),
            (dict(strategies=live.strategies_for("mlp")[:5]), "5 strategies is over .* bound of 4 runs"),
            (dict(steps=0), "steps must be a whole number of at least 1, got 0"),
            (dict(batch=12.5), "global batch must be a whole number"),
            (dict(eval_every="50"), "validate every must be a whole number"),
            (dict(devices=float("nan")), "simulated devices must be a whole number"),
            (dict(strategies=[]), "pick at least one strategy"),
            (dict(strategies=["mpi-allreduce"]), "strategy 'mpi-allreduce' cannot train mlp here"),
            (dict(model="gpt"), "model 'gpt' is not one of"),
            (dict(dataset="imagenet"), "dataset 'imagenet' is not one of")]:
        with pytest.raises(RequestError, match=message):
            check(**changes)
    with pytest.raises(RequestError, match="steps 400 is over this demo's bound of 100"):
        check(small)
    assert check(small, steps=100, devices=2, batch=64, strategies=["single", "single"])["strategies"] == ("single",)


def demo_command(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments", "demo", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_command_refuses_a_shared_host_without_a_password():
    env = {k: v for k, v in os.environ.items() if k != PASSWORD_ENV}
    out = demo_command("--host", "0.0.0.0", env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"--host 0.0.0.0 lets other machines in, so the demo needs a password: set {PASSWORD_ENV}" in out.stderr
    assert "Running on" not in out.stdout  # refused before anything served
    out = demo_command("--max-runs", "0", env=env)
    assert out.returncode == 2 and "must be at least 1" in out.stderr


def test_through_the_pages_api(tmp_path, monkeypatch):
    """A remote client: no login, no page; logged in, every over-bound Start is refused with its
    message and starts nothing, Classify refuses folders outside its own; a Start within the
    bounds does start (so the refusals are the bounds', not a page that starts nothing)."""
    skip_without_gradio()
    from gradio_client import Client

    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    runs = tmp_path / "runs"
    with demo_server(tmp_path, "--dataset", "synthetic", "--max-steps", "100") as server:
        with pytest.raises(Exception, match="credentials were not provided"):  # login first, API too
            Client(server.url, verbose=False)
        with pytest.raises(Exception, match="Could not login"):
            Client(server.url, auth=("visitor", "wrong"), verbose=False)
        client = Client(server.url, auth=("visitor", PASSWORD), verbose=False)

        def start(**changes):
            return client.predict(*{**OK, "steps": 5, **changes}.values(), api_name="/start")

        for changes, message in [(dict(steps=1_000_000_000), "steps 1000000000 is over this demo's bound of 100"),
                                 (dict(devices=4096), "simulated devices 4096 is over"),
                                 (dict(batch=1_000_000), "global batch 1000000 is over"),
                                 (dict(strategies=live.strategies_for("mlp")[:5]), "5 strategies is over")]:
            answer = start(**changes)
            assert answer.startswith("**Not started:**") and message in answer, answer
        assert not runs.exists()  # nothing started, nothing written
        status = client.predict(str(ROOT / "jaxpar"), None, api_name="/load")[0]
        assert "Not loaded" in status and "outside the folders this demo loads from" in status
        answer = start(strategies=["single"], eval_every=5)
        assert answer.startswith("Started 1 runs in"), answer
        assert [p.name for p in runs.iterdir()] and str(ROOT) not in answer  # a relative path
        client.predict(api_name="/stop")
