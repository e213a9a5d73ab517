"""`layer-split`: naive model parallelism: consecutive blocks on consecutive devices.

The model's identical blocks are cut into S equal stages over the STAGE axis (`--mesh
stage=S`); the stem lives with the first stage, the head with the last. Every stage is
its own jitted program on its own device:

    forward   stage 0 -> 1 -> ... -> S-1    each returns its output and its `jax.vjp`
                                            residuals; the output moves on by device_put
    last      loss and its gradient (w.r.t. the last stage's params and input)
    backward  stage S-2 -> ... -> 0         each applies its vjp to the incoming gradient
    update    per stage, `jaxpar.step.apply_update` on that stage's params and optimizer state

One batch at a time, so exactly one device works at any moment: the baseline a pipeline
beats (its bubble is (S-1)/S of the devices' time). The state is a list of S TrainStates,
one per device; `state_to_reference` joins them.

    python -m experiments train --strategy layer-split --model stack-mlp --depth 4 --devices 4 --mesh stage=4
"""

from __future__ import annotations

import time
import types

import jax
import numpy as np
from flax import nnx

from jaxpar import mesh as meshlib
from jaxpar import profile
from jaxpar import step as steplib
from jaxpar.config import ConfigError
from jaxpar.mesh import STAGE
from jaxpar.parallel.base import Strategy
from jaxpar.parallel.blocks import BLOCKS, require_blocks, shell, used_by
from jaxpar.parallel.layout import map_param_trees


class ProgramSet:
    """Several compiled programs seen through one compiled executable's interface, so
    `profile.program_stats` works: FLOPs add up; memory is the largest of each figure (the
    programs run one after another); the HLO texts are concatenated (none has collectives:
    activations move between programs by device_put, accounted separately)."""

    def __init__(self, programs: dict):
        self.programs = programs

    def cost_analysis(self):
        total = 0.0
        for c in self.programs.values():
            cost = c.cost_analysis()
            cost = cost[0] if isinstance(cost, list) and cost else cost
            total += float((cost or {}).get("flops", 0.0))
        return {"flops": total}

    def memory_analysis(self):
        fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                  "alias_size_in_bytes")
        mems = [c.memory_analysis() for c in self.programs.values()]
        return types.SimpleNamespace(**{f: max(int(getattr(m, f, 0)) for m in mems) for f in fields})

    def as_text(self):
        return "\n".join(c.as_text() for c in self.programs.values())


class LayerSplit(Strategy):
    name = "layer-split"
    default_axes = {STAGE: -1}

    def make_mesh(self, devices):
        axes = meshlib.parse_mesh(self.config.parallel.mesh)
        extra = [a for a, s in axes.items() if a != STAGE and s != 1]
        if extra:
            raise meshlib.MeshError(
                f"--strategy {self.name} uses only the {STAGE} axis; drop {', '.join(extra)} "
                "from --mesh (or use --strategy hybrid)")
        return meshlib.make_mesh({STAGE: axes.get(STAGE, -1)}, devices)

    def init(self, model, tx, mesh):
        self.mesh, self.tx = mesh, tx
        self.devices = list(mesh.devices.flat)
        self.s = len(self.devices)
        depth = require_blocks(model, self.name)
        if depth % self.s:
            raise ConfigError(f"--depth {depth} blocks do not divide into {self.s} stages; "
                              f"change --depth or --mesh {STAGE}=")
        self.per_stage = depth // self.s
        self.graphdef, params, model_state = steplib.split_model(model)
        self.template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
        self.block_graphdef = nnx.split(getattr(model, BLOCKS)[0], nnx.Param, ...)[0]

        # The non-block parameters: those `embed` reads go to stage 0, the rest (readout's)
        # to stage S-1. Each end gets a copy of the model without blocks and without the
        # other end's parameters, so it merges from only what that stage holds.
        outer = shell(model)
        outer_params = nnx.to_pure_dict(nnx.state(outer, nnx.Param))
        image = jax.ShapeDtypeStruct((1, 28, 28, 1), np.uint8)
        gd = nnx.split(outer, nnx.Param, ...)[0]
        embed_keys = used_by(lambda p: nnx.merge(gd, p).embed(steplib.normalize(np.zeros(image.shape, np.uint8))),
                             outer_params)
        self.keys = {0: embed_keys, -1: [k for k in outer_params if k not in embed_keys]}
        self.ends = {}
        for end, keep in self.keys.items():
            piece = nnx.clone(outer)
            for key in outer_params:
                if key not in keep:
                    delattr(piece, key)
            self.ends[end] = nnx.split(piece, nnx.Param, ...)[0]

        embed = lambda p: nnx.merge(self.ends[0], p).embed(steplib.normalize(np.zeros(image.shape, np.uint8)))
        act = jax.eval_shape(embed, {k: outer_params[k] for k in self.keys[0]})
        self.act_bytes_per_example = int(np.prod(act.shape)) * act.dtype.itemsize
        ref = steplib.init_state(params, model_state, tx)
        self.stage_templates = [self._stage_tree(self.template, s) for s in range(self.s)]
        self._register_programs()
        return self.state_from_reference(ref)

    # --- layout -----------------------------------------------------------------------------
    def _stage_tree(self, tree, s: int) -> dict:
        """Stage s's part of a parameter-shaped tree: its blocks (original indices kept), plus
        the embedding (s = 0) and the readout (s = S-1) parameters."""
        lo = s * self.per_stage
        out = {BLOCKS: {i: tree[BLOCKS][i] for i in range(lo, lo + self.per_stage)}}
        if s == 0:
            out.update({k: tree[k] for k in self.keys[0]})
        if s == self.s - 1:
            out.update({k: tree[k] for k in self.keys[-1]})
        return out

    def state_from_reference(self, ref):
        return [jax.device_put(map_param_trees(ref, self.template, lambda t, s=s: self._stage_tree(t, s)),
                               self.devices[s]) for s in range(self.s)]

    def state_to_reference(self, state):
        host = jax.device_get(state)
        pieces = [[] for _ in range(self.s)]
        for s in range(self.s):
            map_param_trees(host[s], self.stage_templates[s], lambda t, s=s: pieces[s].append(t) or t)
        joined = iter([self._join(trees) for trees in zip(*pieces)])
        return map_param_trees(host[0], self.stage_templates[0], lambda _: next(joined))

    @staticmethod
    def _join(trees) -> dict:
        out = {BLOCKS: {}}
        for t in trees:
            out[BLOCKS].update(t[BLOCKS])
            out.update({k: v for k, v in t.items() if k != BLOCKS})
        return out

    def place_batch(self, batch):
        """Images to the first stage, labels and weights to the last (where the loss is)."""
        return {k: jax.device_put(v, self.devices[0 if k == "image" else -1]) for k, v in batch.items()}

    # --- the stage programs -----------------------------------------------------------------
    def _apply(self, s: int, p, x):
        """Stage s's computation: (embed), its blocks, (readout)."""
        h = x
        if s == 0:
            h = nnx.merge(self.ends[0], {k: p[k] for k in self.keys[0]}).embed(steplib.normalize(x))
        for i in sorted(p[BLOCKS]):
            h = nnx.merge(self.block_graphdef, p[BLOCKS][i])(h)
        if s == self.s - 1:
            h = nnx.merge(self.ends[-1], {k: p[k] for k in self.keys[-1]}).readout(h)
        return h

    def _register_programs(self):
        last = self.s - 1
        for s in range(last):
            if s == 0:  # no gradient w.r.t. the (integer) images
                fwd = lambda p, x: jax.vjp(lambda p: self._apply(0, p, x), p)
            else:
                fwd = lambda p, x, s=s: jax.vjp(lambda p, x: self._apply(s, p, x), p, x)
            self._register(f"forward{s}", fwd)
            self._register(f"backward{s}", lambda vjp, g: vjp(g))
            self._register(f"eval{s}", lambda p, x, s=s: self._apply(s, p, x))
        self._register("last", self._last)
        self._register("eval_last", self._eval_last)
        for s in range(self.s):
            self._register(f"update{s}", lambda st, g: steplib.apply_update(st, g, self.tx),
                           donate_argnums=0)

    def _last(self, p, x, batch):
        """Loss, its gradient w.r.t. the last stage's params (and input), metric sums."""
        loss = lambda p, x: steplib.loss_from_logits(self._apply(self.s - 1, p, x), batch)
        argnums = 0 if self.s == 1 else (0, 1)
        grads, sums = jax.grad(loss, argnums=argnums, has_aux=True)(p, x)
        return (grads, None, sums) if self.s == 1 else (*grads, sums)

    def _eval_last(self, p, x, batch):
        return steplib.loss_from_logits(self._apply(self.s - 1, p, x), batch)[1]

    def _program(self, name):
        return self.compiled.get(name) or getattr(self, f"_jit_{name}")

    def _split(self, batch):
        tail = {k: v for k, v in batch.items() if k != "image"}
        if self.s == 1:
            tail["image"] = batch["image"]
        return batch["image"], tail

    def _grads(self, state, batch):
        """Forward through the stages, the loss, backward in reverse: per-stage gradients."""
        x, tail = self._split(batch)
        vjps = []
        for s in range(self.s - 1):
            x, vjp = self._program(f"forward{s}")(state[s].params, x)
            vjps.append(vjp)
            x = jax.device_put(x, self.devices[s + 1])  # the activation goes to the next device
        grads = [None] * self.s
        grads[-1], g, sums = self._program("last")(state[-1].params, x, tail)
        for s in reversed(range(self.s - 1)):
            out = self._program(f"backward{s}")(vjps[s], jax.device_put(g, self.devices[s]))
            grads[s], g = out if s else (out[0], None)
        return grads, sums

    def step(self, state, batch):
        grads, sums = self._grads(state, batch)
        return [self._program(f"update{s}")(state[s], grads[s]) for s in range(self.s)], sums

    def gradients(self, state, batch):
        return self._join(self._grads(state, batch)[0])

    def eval_step(self, state, batch):
        x, tail = self._split(batch)
        for s in range(self.s - 1):
            x = jax.device_put(self._program(f"eval{s}")(state[s].params, x), self.devices[s + 1])
        return self._program("eval_last")(state[-1].params, x, tail)

    def compile(self, name, state, batch):
        """AOT-compile every stage program of `step` (or `eval_step`) for these shapes.

        Returns (ProgramSet of the executables, seconds lowering and compiling)."""
        start = time.perf_counter()
        programs = {}

        def aot(prog, *args):
            programs[prog] = getattr(self, f"_jit_{prog}").lower(*args).compile()
            return programs[prog].out_info

        place = lambda tree, s: jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.SingleDeviceSharding(self.devices[s])), tree)
        x, tail = self._split(batch)
        acts = []
        prefix = "eval" if name == "eval_step" else "forward"
        for s in range(self.s - 1):
            out = aot(f"{prefix}{s}", state[s].params, x)
            x = place(out if name == "eval_step" else out[0], s + 1)
            acts.append((out, x))
        if name == "eval_step":
            aot("eval_last", state[-1].params, x, tail)
        else:
            grads = [None] * self.s
            grads[-1], g, _ = aot("last", state[-1].params, x, tail)
            for s in reversed(range(self.s - 1)):
                out = aot(f"backward{s}", acts[s][0][1], place(g, s))
                grads[s], g = out if s else (out[0], None)
            for s in range(self.s):
                aot(f"update{s}", state[s], grads[s])
            self.activation_bytes = [profile.tree_bytes(a[1]) for a in acts]
        self.compiled.update(programs)
        return ProgramSet(programs), time.perf_counter() - start

    # --- accounting -------------------------------------------------------------------------
    def describe(self) -> dict:
        return {**super().describe(), "axes": {STAGE: "consecutive blocks"},
                "blocks_per_stage": self.per_stage}

    def transfer_theory(self) -> int:
        """Bytes moved between devices per step: the residual stream of the whole batch
        crosses each of the S-1 stage boundaries once forward, its gradient once backward."""
        return 2 * (self.s - 1) * self.config.data.batch_size * self.act_bytes_per_example

    def accounting(self, step_stats, state):
        """No collectives: activations move between devices by device_put, S-1 times forward
        and S-1 times backward; state bytes are the largest stage's."""
        per_stage = [profile.tree_bytes((st.params, st.opt_state)) for st in state]
        blocks = [profile.tree_bytes(st.params[BLOCKS]) for st in state]
        moved = 2 * sum(getattr(self, "activation_bytes", []))
        return {
            "collective_bytes_per_step": step_stats["collective_bytes"].get("total", 0),
            "collective_bytes_by_op": step_stats["collective_bytes"],
            "collective_bytes_theory": self.theory(),
            "activation_transfer_bytes_per_step": moved,
            "activation_transfer_bytes_theory": self.transfer_theory(),
            "state_bytes_per_device": max(per_stage),
            "state_bytes_per_stage": per_stage,
            "param_bytes_per_stage": [profile.tree_bytes(st.params) for st in state],
            "block_param_bytes_per_stage": blocks,
            "block_param_bytes_total": profile.tree_bytes(self.template[BLOCKS]),
            "memory_per_device": step_stats["memory"],
            "busy_fraction": 1.0 / self.s,  # one device works at a time
        }
