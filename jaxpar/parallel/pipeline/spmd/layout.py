"""A model cut into stages of different shapes, as one SPMD program holds and runs them.

Stages of a real model differ: the CNN's first stage holds 320 parameters and hands on
[14, 14, 32] per example, its last holds 400 k and returns logits. Inside one SPMD program
(`pipeline`, `gems`, `hybrid`) every device must hold arrays of one shape, so:

- a stage's parameters (and batch-norm statistics) are raveled into one vector, padded to
  the largest stage's, stored [S, R, P] (stage, replica copy, element) and sharded over
  STAGE; the optimizer updates these vectors element-wise like any parameter;
- the activation crossing a stage boundary is raveled per example into a buffer of the
  largest boundary's size A, [rows, A]; the last stage writes its logits there;
- each stage's function is a branch of `lax.switch` on the stage index: it unravels its own
  parameters and input with static shapes, merges them into the model (other stages'
  parameters as zeros the compiler drops) and runs its layers (`model.layers()`).

Cost of the choice, reported by the strategies' `describe`: every send between stages moves
the whole [rows, A] buffer, so a boundary narrower than A sends (A - its size) x rows x 4
padding bytes; every device stores P x R elements of each parameter-shaped tree, S x R x P
minus the model's count being padding (the optimizer's element-wise update runs over it).
The padding costs no FLOPs (slices, reshapes), and `lax.switch` runs only the device's own
stage. The alternatives cost more: stacking stages needs identical blocks; one program per
stage (`layer-split`) cannot overlap micro-batches.

    stages = PaddedStages(model, starts=(0, 2, 3), rows=16)
    buffers = stages.params.pack(params)           # {"rep": [S, 1, P]} (numpy)
    out, new_state = stages.forward(s, p, z, h, train=True)   # inside shard_map, s static
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar import step as steplib
from jaxpar.data import IMAGE_SHAPE  # the default image shape (a dataset's own: `image_shape`)
from jaxpar.models.sequence import Key
from jaxpar.parallel import layout
from jaxpar.parallel.layout import leaves, nest

REP, SPLIT = "rep", "split"  # buffers: replicated over TENSOR, and split over it (hybrid)


class FlatLayout:
    """Where each leaf of a parameter-shaped tree lives in its stage's flat vectors.

    Args:
      template: the tree (its leaves' shapes and dtype; one dtype throughout).
      stage_keys: per stage, the paths its layers own; a leaf belongs to the stage owning a
        prefix of its path.
      replicas: for device d, the stage each replica copy holds (`gems`: d and S-1-d).
      split: path -> the dimension split over TENSOR into `degree` slices, or None.
    """

    def __init__(self, template, stage_keys: list[list[Key]],
                 replicas: Callable[[int], list[int]] = lambda d: [d],
                 split: Callable[[Key], int | None] = lambda path: None, degree: int = 1):
        self.template, self.degree, self.replicas = layout.abstract(template), degree, replicas
        self.S = len(stage_keys)
        self.dtype = jnp.float32
        self.entries: list[list[tuple]] = [[] for _ in range(self.S)]  # (path, kind, shape, dim, offset)
        sizes = [{REP: 0, SPLIT: 0} for _ in range(self.S)]
        for path, leaf in leaves(self.template):
            s = next((s for s, keys in enumerate(stage_keys)
                      if any(path[:len(k)] == tuple(k) for k in keys)), None)
            if s is None:
                raise ValueError(f"parameter {path} belongs to no layer of model.layers()")
            self.dtype = leaf.dtype
            dim = split(path) if degree > 1 else None
            kind, shape = (REP, leaf.shape) if dim is None else (SPLIT, _local(leaf.shape, dim, degree))
            self.entries[s].append((path, kind, leaf.shape, dim, sizes[s][kind]))
            sizes[s][kind] += math.prod(shape)
        self.sizes = sizes
        self.width = {k: max(sz[k] for sz in sizes) for k in (REP, SPLIT)}

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(k for k in (REP, SPLIT) if self.width[k] or k == REP)

    def padding_elements(self) -> int:
        """Elements stored beyond the tree's own, over every device and replica copy."""
        stored = sum(self.width[k] * self.S * len(self.replicas(0)) * (self.degree if k == SPLIT else 1)
                     for k in self.kinds)
        return stored - sum(math.prod(x.shape) for _, x in leaves(self.template)) * len(self.replicas(0))

    # --- host side: reference tree <-> stage rows -------------------------------------------
    def pack(self, tree) -> dict[str, np.ndarray]:
        """{"rep": [S, R, P]} (+ {"split": [S, T, R, Q]}) from a reference-layout tree."""
        values = dict(leaves(jax.device_get(tree)))
        rows = [{k: np.zeros((self.degree if k == SPLIT else 1, self.width[k]), self.dtype) for k in self.kinds}
                for _ in range(self.S)]
        for s, entries in enumerate(self.entries):
            for path, kind, shape, dim, offset in entries:
                value = np.asarray(values[path], self.dtype)
                for t in range(self.degree if kind == SPLIT else 1):
                    part = value if dim is None else np.split(value, self.degree, axis=dim)[t]
                    rows[s][kind][t, offset:offset + part.size] = part.ravel()
        out = {}
        for k in self.kinds:
            per_device = np.stack([np.stack([rows[st][k] for st in self.replicas(d)], 1)
                                   for d in range(self.S)])  # [S, T, R, width]
            out[k] = per_device[:, 0] if k == REP else per_device
        return out

    def unpack(self, buffers) -> dict:
        """The reference-layout tree from `pack`'s buffers (replica copy 0 of each stage)."""
        buffers = {k: np.asarray(jax.device_get(v)) for k, v in buffers.items()}
        owner = {self.replicas(d)[0]: d for d in range(self.S)}
        items = []
        for s, entries in enumerate(self.entries):
            d = owner[s]
            for path, kind, shape, dim, offset in entries:
                if kind == REP:
                    items.append((path, buffers[REP][d, 0, offset:offset + math.prod(shape)].reshape(shape)))
                    continue
                local = _local(shape, dim, self.degree)
                parts = [buffers[SPLIT][d, t, 0, offset:offset + math.prod(local)].reshape(local)
                         for t in range(self.degree)]
                items.append((path, np.concatenate(parts, axis=dim)))
        return nest(items)

    # --- device side: one stage's vectors <-> its sub-tree (static s, inside the program) ---
    def local(self, s: int, vectors: dict[str, jax.Array]) -> list[tuple[Key, jax.Array]]:
        """Stage s's (path, leaf) from its vectors ({"rep": [P], "split": [Q]}), local shapes.

        One `jnp.split` per vector (its gradient is one concatenation), not a slice per leaf:
        XLA:CPU (jax 0.10.2) drops one of two identical gradients transposed from slices of one
        vector (the ResNet's last bn2 and projection-BN biases), and a split is cheaper anyway.
        """
        out = []
        for kind in self.kinds:
            entries = [e for e in self.entries[s] if e[1] == kind]
            shapes = [shape if dim is None else _local(shape, dim, self.degree)
                      for _, _, shape, dim, _ in entries]
            cuts = np.cumsum([math.prod(x) for x in shapes]).tolist()
            pieces = jnp.split(vectors[kind], cuts)  # the last piece is the padding
            out += [(e[0], piece.reshape(shape)) for e, piece, shape in zip(entries, pieces, shapes)]
        return out

    def ravel(self, s: int, items: dict[Key, jax.Array]) -> dict[str, jax.Array]:
        """Stage s's vectors from {path: leaf} (local shapes), zero padded."""
        parts: dict[str, list] = {k: [] for k in self.kinds}
        for path, kind, *_ in self.entries[s]:
            parts[kind].append(items[path].ravel().astype(self.dtype))
        return {k: jnp.pad(jnp.concatenate(p) if p else jnp.zeros((0,), self.dtype),
                           (0, self.width[k] - sum(x.size for x in p))) for k, p in parts.items()}

    def full(self, stage_items: list[tuple[Key, jax.Array]]) -> dict:
        """The whole tree: `stage_items`, zeros elsewhere (unused there; the compiler drops them)."""
        mine = dict(stage_items)
        return nest([(path, mine[path] if path in mine else jnp.zeros(x.shape, x.dtype))
                     for path, x in leaves(self.template)])


def _local(shape, dim: int, degree: int) -> tuple[int, ...]:
    return tuple(n // degree if i == dim else n for i, n in enumerate(shape))


class PaddedStages:
    """A model cut at `starts` (first layer of each stage) for `rows`-row micro-batches: its
    stage layouts (parameters, batch-norm statistics) and the boundary activation buffer.

    Args:
      replicas, split, degree: as for `FlatLayout` (gems: two copies; hybrid: TENSOR split).
      split_layer: (model, layer index) -> that layer's tensor-split function or None (hybrid).
    """

    def __init__(self, model: nnx.Module, starts: tuple[int, ...], rows: int, *,
                 image_shape: tuple[int, ...] = IMAGE_SHAPE,
                 replicas: Callable[[int], list[int]] = lambda d: [d],
                 split: Callable[[Key], int | None] = lambda path: None, degree: int = 1,
                 split_layer: Callable | None = None):
        self.graphdef, params, state = steplib.split_model(model)
        layers = model.layers()
        self.names = [layer.name for layer in layers]
        self.S, self.rows, self.split_layer = len(starts), rows, split_layer
        self.ranges = [range(a, b) for a, b in zip(starts, (*starts[1:], len(layers)))]
        keys = [[k for i in r for k in layers[i].keys] for r in self.ranges]
        self.params = FlatLayout(params, keys, replicas, split, degree)
        self.state = FlatLayout(state, keys, replicas, split, degree)
        self.state_template = state
        # Per-example activation shapes: the image, then the output of each stage.
        h = jax.ShapeDtypeStruct((1, *image_shape), jnp.float32)
        self.shapes = [h.shape[1:]]
        for r in self.ranges:
            h = jax.eval_shape(lambda x, r=r: self._run(model, r, x, False), h)
            self.shapes.append(h.shape[1:])
        self.classes = self.shapes[-1][0]
        self.boundaries = [math.prod(s) for s in self.shapes[1:-1]]  # elements per example
        self.width = max([*self.boundaries, self.classes])

    @staticmethod
    def _run(model, layer_range, h, train, split_layer=None):
        layers = model.layers()
        for i in layer_range:
            fn = split_layer(model, i) if split_layer else None
            h = fn(h, train) if fn else layers[i](h, train)
        return h

    def stage_of_layers(self) -> list[list[str]]:
        return [[self.names[i] for i in r] for r in self.ranges]

    def forward(self, s: int, params: dict, state: dict, inp: jax.Array, train: bool):
        """Stage s (static) on one micro-batch, inside the SPMD program.

        Args:
          params, state: this stage's vectors ({"rep": [P]} (+ "split")) for one replica copy;
            state {} when the model has no batch norm.
          inp: images [rows, 28, 28, 1] (stage 0) or the boundary buffer [rows, A].
        Returns:
          (out [rows, A]: the activation for stage s + 1, or the logits on the last stage,
           zero padded; the stage's batch-norm statistics after the call, as vectors)
        """
        p_items = self.params.local(s, params)
        z_items = self.state.local(s, state) if state else []  # {}: no batch norm
        model = nnx.merge(self.graphdef, self.params.full(p_items), self.state.full(z_items))
        if s == 0:
            h = steplib.normalize(inp)
        else:
            h = inp[:, :self.boundaries[s - 1]].reshape(inp.shape[0], *self.shapes[s])
        h = self._run(model, self.ranges[s], h, train, self.split_layer)
        h = h.reshape(h.shape[0], -1)
        out = jnp.pad(h, ((0, 0), (0, self.width - h.shape[1])))
        if not (train and self.state.width[REP]):
            return out, state
        new = dict(leaves(nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))))
        return out, self.state.ravel(s, new)

    def padding_bytes_per_send(self) -> list[int]:
        """Per boundary s -> s+1: padding bytes in one micro-batch's send (f32)."""
        return [(self.width - n) * self.rows * 4 for n in self.boundaries]

    def describe(self) -> dict:
        return {"stage_layers": self.stage_of_layers(),
                "boundary_elements_per_example": self.boundaries,
                "activation_buffer_elements_per_example": self.width,
                "param_elements_per_stage": [sz[REP] + sz[SPLIT] for sz in self.params.sizes],
                "param_padding_elements": self.params.padding_elements()}
