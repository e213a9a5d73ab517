"""A host-driven pipeline's training state: per stage copy (replica, stage) its parameters,
optimizer state and batch-norm statistics on its device, as tuples in `copies` order; and
the single-device layout it converts to and from (what checkpoints hold).

    states = StageStates(fns, placement, plan, tx)
    state = states.from_reference(reference_state)
    states.copy(state.params, r, s)
"""

from __future__ import annotations

import jax
from jax.sharding import SingleDeviceSharding

from jaxpar import step as steplib
from jaxpar.parallel.layout import pick
from jaxpar.parallel.pipeline.host.placement import Placement
from jaxpar.parallel.pipeline.stage_fns import StageFunctions
from jaxpar.parallel.transport import processes


class StageStates:
    def __init__(self, fns: StageFunctions, placement: Placement, plan, tx):
        self.fns, self.placement, self.plan, self.tx = fns, placement, plan, tx
        self.S = fns.stages

    @property
    def copies(self) -> list[tuple[int, int]]:
        """(replica, stage) of every copy of a stage, in the order the state's tuples hold them."""
        return [(r, s) for r in range(self.fns.replicas) for s in range(self.S)]

    def copy(self, tree, r: int, s: int):
        return tree[r * self.S + s]

    def from_reference(self, ref):
        ref = self.plan.to_view(jax.device_get(ref))
        place, fns = self.placement.place, self.fns
        params, opts, stats = [], [], []
        for r, s in self.copies:
            p = fns.own(ref.params, s)
            params.append(place(p, s, r, "params"))
            opts.append(place(pick(jax.eval_shape(self.tx.init, p), [ref.opt_state]), s, r, "opt"))
            stats.append(place(fns.own(ref.model_state, s), s, r, "stats"))
        step = processes.place(ref.step, SingleDeviceSharding(self.placement.devices[0]))
        return steplib.TrainState(step=step, params=tuple(params), opt_state=tuple(opts),
                                  model_state=tuple(stats))

    def to_reference(self, state):
        mine = slice(0, self.S)  # replica 0's copies: every replica holds the same values
        state = processes.fetch_held(state.replace(params=state.params[mine], opt_state=state.opt_state[mine],
                                                   model_state=state.model_state[mine]))
        shapes = self.fns.shapes
        return self.plan.from_view(steplib.TrainState(
            step=state.step, params=pick(shapes, list(state.params)),
            opt_state=pick(jax.eval_shape(self.tx.init, shapes), list(state.opt_state)),
            model_state=pick(self.fns.state_shapes, list(state.model_state))))

    def place_batch(self, batch):
        """Each replica's images on its first stage, labels and weights on its last (where the
        loss is); every replica gets the whole (padded) batch and takes its own micro-batches."""
        out = {k: [] for k in ("image", "label", "weight")}
        last = self.S - 1
        for r in range(self.fns.replicas):
            out["image"].append(self.placement.place(batch["image"], 0, r, "rows"))
            out["label"].append(self.placement.place(batch["label"], last, r, "rows"))
            out["weight"].append(self.placement.place(batch["weight"], last, r, "rows"))
        return {k: tuple(v) for k, v in out.items()}

    def stage_param_bytes(self) -> list[int]:
        """Parameter bytes each device of a stage holds."""
        return [self.placement.local_bytes(self.fns.own(self.fns.shapes, s), s) for s in range(self.S)]
