"""The errors a user can fix by changing what they typed or installed.

The bottom layer of the package: it imports nothing from jaxpar, so every module (the
strategies below the loop included) can raise these without an import circle. The CLI prints
their message alone, without a traceback, and exits with status 2. A diverged run exits 3, and
a multi-process job that lost a process (`PeerLost`) 75.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input, a missing install or file: the message names the fix."""


class ConfigError(UserError, ValueError):
    """An option value that cannot work; the message names the option to change."""


class MeshError(ConfigError):
    """A mesh that cannot be built from the devices present (message names the fix)."""


class DataError(UserError):
    """A data set is missing or unreadable; the message says what to do."""


class ResultsError(UserError):
    """Results cannot be written or read; the message names the fix."""


class Diverged(Exception):
    """Training stopped being finite (the loss, or the state about to be checkpointed): the run
    stops at once with exit status 3, and nothing is checkpointed from that state. `result`
    (a RunResult with status "diverged") is what the run writes instead."""

    exit_code = 3

    def __init__(self, step: int, last_finite_loss: float | None, lr: float, what: str = "loss"):
        self.step, self.last_finite_loss, self.result = step, last_finite_loss, None
        last = ("no step before it had a finite loss" if last_finite_loss is None else
                f"the last finite loss was {last_finite_loss:.4g}")
        super().__init__(
            f"training diverged at step {step}: the {what} is not finite ({last}). Nothing was "
            f"checkpointed from that state; the last good checkpoint, if any, is the one --resume "
            f"takes. Lower --lr (it was {lr:g}) or warm up (--lr-schedule warmup-cosine "
            "--warmup-steps N).")


class PeerLost(Exception):
    """Another process of a multi-process job went silent or away (a cut link, a lost host, a
    killed rank): no wait for it finished within --collective-timeout, or the transport
    between them failed. The watchdog (`jaxpar.runtime.watchdog`) ends the whole job with exit
    status 75 (sysexits' EX_TEMPFAIL: the fault is the machine's, not the run's, and the same
    command goes on from the latest checkpoint under --resume auto), naming who went silent."""

    exit_code = 75
