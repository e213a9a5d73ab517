"""A PyTorch point of the peers study as data (this module imports neither torch nor JAX: the
PyTorch processes read it), and whether a folder holds its result.

    python -m experiments.peers.torch_bench OUT/FOLDER/point.json    # runs the point it describes
    python -m experiments.peers.torch_parallel OUT/FOLDER/point.json  # (pipelining, tensor parallelism)

`experiments.peers.torch_launch` writes OUT/FOLDER/point.json (the settings) and starts
`python -m MODULE OUT/FOLDER/point.json` (`module`), which writes OUT/FOLDER/torch.json
recording the settings it ran. Before any work the study calls `stored_torch_point` on every
point already in OUT: a complete result of the same settings is reused, a damaged one is run
again, and one of other settings is refused (ConfigError naming the folder).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from jaxpar.errors import ConfigError

# torch.distributed.pipelining's schedule class of each jaxpar schedule (the same orders).
PIPELINE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                    "interleaved-1f1b": "ScheduleInterleaved1F1B", "looped-bfs": "ScheduleLoopedBFS",
                    "zb-h1": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
                    "dualpipev": "ScheduleDualPipeV"}
PIPELINE_MODES = tuple(PIPELINE_CLASSES)
TORCH_MODES = ("eager", "compile", "ddp", *PIPELINE_MODES, "tp")
# Modes of `ranks` gloo processes: data parallel, the pipelining schedules, tensor parallel.
RANK_MODES = ("ddp", *PIPELINE_MODES, "tp")
# The process each mode runs in: model parallelism in its own module (it builds on torch_bench).
MODEL_PARALLEL_MODES = (*PIPELINE_MODES, "tp")


def module(mode: str) -> str:
    """The module whose `python -m` runs a point of `mode`."""
    return "experiments.peers.torch_parallel" if mode in MODEL_PARALLEL_MODES else "experiments.peers.torch_bench"


# PyTorch's Adam kernels on CPU, by the study's --adam name: torch.optim.Adam's arguments.
# Untold, PyTorch picks the for-loop one on CPU.
ADAM_KERNELS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
RESULT_FILE = "torch.json"


@dataclass(frozen=True)
class TorchPoint:
    """One PyTorch measurement: the twin of jaxpar model `model`, trained step by step.

    Attributes:
      folder: where its files go, under the study's --out.
      mode: eager | compile (one process) | ddp | a pipeline schedule (PIPELINE_CLASSES:
        torch.distributed.pipelining, a stage or several per rank) | tp (DTensor tensor
        parallelism): `ranks` gloo processes, 1 thread each.
      ranks: processes (1 unless mode is one of RANK_MODES).
      adam: a key of ADAM_KERNELS; lr: Adam's learning rate (constant).
      matmul_peak: also time a 2048^3 f32 matmul at the point's threads.
      device: where the model runs, a torch device ("cpu", "cuda"); eager and compile only.
      microbatches: micro-batches per global batch (pipelines only).
      stage_starts: first layer of each stage (pipelines only).
      stage_ranks: the rank of each stage (pipelines with several stages per rank; None: stage
        s on rank s), as jaxpar's schedule places them.
      cut_channels: the CNN's conv2 held as two layers split after this output channel, as
        jaxpar's pipelines cut it (`jaxpar.parallel.pipeline.inner_cut`); None: whole layers.
    """

    folder: str
    model: str
    mode: str
    batch_size: int
    iters: int
    warmup: int
    ranks: int
    adam: str
    lr: float
    matmul_peak: bool
    device: str = "cpu"
    microbatches: int | None = None
    stage_starts: tuple[int, ...] | None = None
    cut_channels: int | None = None
    stage_ranks: tuple[int, ...] | None = None

    def settings(self) -> dict:
        """What its result must record to be reused (everything but where it lives, and the
        pipeline fields where unset: points measured before they existed still match)."""
        unset = {k for k in PIPELINE_FIELDS if getattr(self, k) is None}
        return json.loads(json.dumps({k: v for k, v in dataclasses.asdict(self).items()
                                      if k != "folder" and k not in unset}))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "TorchPoint":
        d = json.loads(text)
        tuples = {k: None if d.get(k) is None else tuple(d[k]) for k in ("stage_starts", "stage_ranks")}
        return cls(**{**d, **tuples})


PIPELINE_FIELDS = ("microbatches", "stage_starts", "cut_channels", "stage_ranks")


def stored_torch_point(folder: Path, point: TorchPoint) -> dict | None:
    """The complete result in FOLDER if it ran POINT's settings; None when there is none or it
    is damaged (run it again); ConfigError when it ran other settings."""
    try:
        done = json.loads((folder / RESULT_FILE).read_text())
        have = {"device": "cpu", **done["point"]}  # written before points had a device: the CPU
        float(done["median_ms"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if have != point.settings():
        diff = [f"{k} {have.get(k)} (asked {v})" for k, v in point.settings().items() if have.get(k) != v]
        raise ConfigError(f"{folder} holds a point measured with other settings "
                          f"({', '.join(diff) or have}); pass a fresh --out or delete that folder")
    return done
