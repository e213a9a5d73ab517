"""What makes the demo safe to share: a password beyond this machine, bounds on what one
request may start, and the folders Classify may read.

    python -m experiments demo --host 0.0.0.0 --password ...    # or JAXPAR_DEMO_PASSWORD=...
    python -m experiments demo --max-steps 20000 --max-runs 6   # the trusted operator's bounds

Every request the page accepts can also come through its API (gradio_client, any machine that
reaches the port), so the bounds are checked on the server, on the values received, before
anything stops or starts; the page's own fields only make the bounds visible.
"""

from __future__ import annotations

import hmac
import ipaddress
import math
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from jaxpar.errors import ConfigError, UserError

PASSWORD_ENV = "JAXPAR_DEMO_PASSWORD"  # the password, out of `ps` and shell histories


class RequestError(UserError):
    """A request the demo will not start; the message says which bound and how to stay in it."""


@dataclass(frozen=True)
class Limits:
    """The most one Start may ask for. Defaults fit a lecture on a laptop: the default runs
    (400 steps, batch 128, 2 devices, 2 strategies) with room to spare, minutes not hours of
    CPU each. The operator raises them with the demo's --max-* options."""

    max_steps: int = 5000
    max_devices: int = 8     # simulated CPU devices per run (each a thread pool of XLA's)
    max_batch: int = 1024    # global batch
    max_runs: int = 4        # strategies of one Start, so training processes at once (a Start
                             # stops the previous group first)

    def check(self, model, dataset, strategies, devices, steps, batch, eval_every, *,
              models: list[str], datasets: list[str],
              strategies_for: Callable[[str], list[str]]) -> dict[str, Any]:
        """One Start's request, values as received (through the page or its API), as
        `live.RunSpec`'s fields; RequestError naming the first bound or choice it breaks.

        Args:
          models, datasets, strategies_for: the choices (passed in: this module stays free of
            JAX, so the CLI imports it at no cost).
        """
        if model not in models:
            raise RequestError(f"model {model!r} is not one of {', '.join(models)}")
        if dataset not in datasets:
            raise RequestError(f"dataset {dataset!r} is not one of {', '.join(datasets)}")
        counts = {"simulated devices": (devices, self.max_devices, "--max-devices"),
                  "steps": (steps, self.max_steps, "--max-steps"),
                  "global batch": (batch, self.max_batch, "--max-batch"),
                  "validate every": (eval_every, None, None)}
        whole = {name: _whole(value, name) for name, (value, _, _) in counts.items()}
        for name, (_, bound, flag) in counts.items():
            if bound is not None and whole[name] > bound:
                raise RequestError(f"{name} {whole[name]} is over this demo's bound of {bound}; ask "
                                   f"for at most {bound} (the person running the demo sets it "
                                   f"with {flag})")
        if isinstance(strategies, str):  # one name through the API
            strategies = [strategies]
        chosen = tuple(dict.fromkeys(strategies or ()))  # each strategy once, in order
        allowed = strategies_for(model)
        unknown = [s for s in chosen if s not in allowed]
        if unknown:
            raise RequestError(f"strategy {unknown[0]!r} cannot train {model} here; pick from "
                               f"{', '.join(allowed)}")
        if not chosen:
            raise RequestError("pick at least one strategy (two or more to compare)")
        if len(chosen) > self.max_runs:
            raise RequestError(f"{len(chosen)} strategies is over this demo's bound of "
                               f"{self.max_runs} runs at once; pick at most {self.max_runs} (the "
                               "person running the demo sets it with --max-runs)")
        return {"model": model, "dataset": dataset, "strategies": chosen,
                "devices": whole["simulated devices"], "steps": whole["steps"],
                "batch_size": whole["global batch"], "eval_every": whole["validate every"]}


def _whole(value, name: str) -> int:
    """A count from the page (a float from a number field, or anything through the API)."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or value != int(value) or value < 1):
        raise RequestError(f"{name} must be a whole number of at least 1, got {value!r}")
    return int(value)


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def password_from(option: str | None) -> str | None:
    """--password, else $JAXPAR_DEMO_PASSWORD, else None (there is no default password)."""
    value = option if option is not None else os.environ.get(PASSWORD_ENV)
    if value is not None and not value.strip():
        raise ConfigError(f"the demo's password is empty; give one with --password or {PASSWORD_ENV}")
    return value


def auth_for(host: str, password: str | None) -> Callable[[str, str], bool] | None:
    """Gradio's `auth` for `host`: any user name with `password`; None (no login) on loopback
    without a password. ConfigError beyond loopback without one: the page would let anyone on
    the network start training processes."""
    if password is None:
        if is_loopback(host):
            return None
        raise ConfigError(f"--host {host} lets other machines in, so the demo needs a password: "
                          f"set {PASSWORD_ENV} (or pass --password), and visitors log in with it; "
                          "or serve on 127.0.0.1")

    def check(_user: str, given: str) -> bool:
        return hmac.compare_digest(given.encode(), password.encode())  # no timing hint

    return check


def inside(path: Path, roots: list[Path]) -> bool:
    """Whether `path` (symbolic links followed) lies in one of `roots`."""
    real = path.resolve()
    return any(real.is_relative_to(root.resolve()) for root in roots)
