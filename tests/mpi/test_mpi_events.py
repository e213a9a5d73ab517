"""`train --events` across processes: every rank trains, rank 0 alone writes the stream (a live
view such as the demo reads each step once, not once per rank).

    mpiexec -n 2 python -m mpi4py -m pytest -q tests/mpi
"""

import json
import tempfile
from pathlib import Path

import jax

from jaxpar.config import TrainConfig, with_options
from jaxpar.train import fit


def test_rank_zero_alone_writes_events(comm):
    folder = comm.bcast(tempfile.mkdtemp() if comm.Get_rank() == 0 else None)  # one file for all
    events = Path(folder) / "events.jsonl"
    config = with_options(TrainConfig(), dataset="synthetic", synthetic_size=800, val_size=0,
                          batch_size=16 * comm.Get_size(), model="mlp", width=32, depth=1, steps=6,
                          progress=False, strategy="dp-auto", events=str(events))
    fit(config)
    comm.Barrier()
    assert jax.process_count() == comm.Get_size()
    records = [json.loads(line) for line in events.read_text().splitlines()]
    kinds = [r["event"] for r in records]
    assert kinds == ["start"] + ["step"] * 6 + ["end"]
    assert records[0]["strategy"]["devices"] == comm.Get_size()
