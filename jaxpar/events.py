"""`--events FILE`: one JSON object per line as a run goes, for live views (the demo).

Records: "start" (before the first step: compile time, collective bytes, memory per device,
the strategy), "step" (each logged step: loss, accuracy, images/s), "validation" (each
validation record) and "end" (the metrics, the status and the result path).

    {"event": "step", "time": 1795570729.5, "step": 40, "loss": 0.61, "accuracy": 0.79, ...}
"""

from __future__ import annotations

import json
import time
from typing import Any

import jax

from jaxpar.errors import ResultsError


def log(path: str | None, event: str, **fields: Any) -> None:
    """Append one record to `path` (nothing without one; the first process only)."""
    if not path or jax.process_index() != 0:
        return
    # Opened per record and closed (flushed) at once: a reader never waits on a buffer. The
    # first record comes before any training step, so a bad path costs no training.
    try:
        with open(path, "a") as f:
            f.write(json.dumps({"event": event, "time": time.time(), **fields}, default=float) + "\n")
    except OSError as e:
        raise ResultsError(f"cannot append to --events {path!r} ({e.strerror or e}); pass a file "
                           "in a folder that exists and that you can write to") from e
