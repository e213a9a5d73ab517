"""What one pipeline stage computes, as pure functions of its own arrays: the narrow table
every pipeline runtime calls (the host walk jits each per stage and device, one program per
device and the MPI ranks call them inside their step), so no runtime reaches into a strategy.

For stage s of a model cut into stages (`Cut`: the model in the cut's layout, each stage's
layer range and parameter keys):

- `forward(s, params, stats, x, train)`: the stage on `x` (stage 0 normalises the images);
  its output and batch-norm statistics after the call;
- `train_forward`: a training forward returning its `jax.vjp` (a pytree of residuals kept
  for the backward) or, with `remat`, nothing (the backward recomputes it from its input);
- `backward` / `backward_remat`: the vjp applied to the incoming gradient, added into the
  stage's gradient accumulator, and the gradient of the stage's input to send back;
- `last`: the last stage's forward, loss (the global batch's denominator) and backward at
  once, so the last stage keeps no residuals;
- for schedules that split the backward (zero bubble), the same work layer by layer
  (`layers_forward`: a vjp per layer; `backward_input`: the input gradient alone, keeping
  each layer's output cotangent and what of its backward the weight gradient reads;
  `backward_weight`: the parameter gradients from what the input gradient kept, so no work
  is done twice (`split_backward`); `last_input`: the last stage's forward, loss and input
  gradient);
- `update`: the shared optimizer update (`step.apply_update`) of the stage's parameters;
- `zeros`, `split_images`, `split_labels`: accumulators and one replica's micro-batches.

Batch norm normalises each micro-batch by its own statistics; the running statistics after a
step are the mean over the micro-batches of each one's update (`update` divides by M).

    fns = StageFunctions(cut, tx, microbatches=8, replicas=1, remat=False)
    out, vjp, z = fns.train_forward(0, params, stats, images, z)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar import step as steplib
from jaxpar.parallel import layout
from jaxpar.parallel.layout import pick
from jaxpar.parallel.pipeline import split_backward


@dataclasses.dataclass
class StageFunctions:
    """The stages of `model` (already in the cut's layout: `inner_cut.Plan.stages`).

    Attributes:
      graphdef, shapes, state_shapes: the cut model's structure, parameter and batch-norm
        statistics shapes (ShapeDtypeStructs).
      ranges, keys: per stage, its layers' indices and parameter paths.
    """
    graphdef: Any
    shapes: Any
    state_shapes: Any
    ranges: list[range]
    keys: list[list[tuple]]
    tx: optax.GradientTransformation
    microbatches: int
    replicas: int = 1
    remat: bool = False

    @classmethod
    def of(cls, model, ranges, keys, tx, microbatches, replicas=1, remat=False) -> "StageFunctions":
        graphdef, params, state = steplib.split_model(model)
        return cls(graphdef, layout.abstract(params), layout.abstract(state), ranges, keys, tx,
                   microbatches, replicas, remat)

    @property
    def stages(self) -> int:
        return len(self.ranges)

    def own(self, tree, s: int) -> dict:
        """Stage s's sub-dict of `tree` (parameters, or batch-norm statistics): its layers'."""
        return layout.owned(tree, self.keys[s])

    def join(self, stage_trees: list) -> dict:
        """The whole model's parameter-shaped tree from each stage's (in the cut's layout)."""
        return pick(self.shapes, stage_trees)

    # --- the stage's work ------------------------------------------------------------------
    def forward(self, s, params, stats, x, train):
        """Stage s on `x`: its output and its batch-norm statistics after the call."""
        # Other stages' entries are zeros made inside the program; unused, so XLA drops them.
        zeros = lambda t: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), t)  # noqa: E731
        model = nnx.merge(self.graphdef, pick(self.shapes, [params, zeros(self.shapes)]),
                          pick(self.state_shapes, [stats, zeros(self.state_shapes)]))
        layers = model.layers()
        h = steplib.normalize(x) if s == 0 else x
        for i in self.ranges[s]:
            h = layers[i](h, train)
        new = self.own(nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param))), s)
        return h, (new if train else stats)

    def train_forward(self, s, params, stats, x, z_sum):
        """(output, its vjp or nothing with remat, z_sum + the stage's statistics)."""
        add = lambda new: jax.tree.map(jnp.add, z_sum, new)  # noqa: E731
        if self.remat:
            out, new = self.forward(s, params, stats, x, True)
            return out, None, add(new)
        out, vjp, new = self.vjp(s, params, stats, x)
        return out, vjp, add(new)

    def vjp(self, s, params, stats, x):
        if s == 0:  # the input is the image batch: no gradient to send back
            return jax.vjp(lambda p: self.forward(0, p, stats, x, True), params, has_aux=True)
        return jax.vjp(lambda p, h: self.forward(s, p, stats, h, True), params, x, has_aux=True)

    def backward(self, s, vjp, g, acc):
        """The stage's vjp on the incoming gradient: (acc + parameter gradients, input gradient)."""
        grads = vjp(g)
        return jax.tree.map(jnp.add, acc, grads[0]), (grads[1] if s > 0 else None)

    def backward_remat(self, s, params, stats, x, g, acc):
        return self.backward(s, self.vjp(s, params, stats, x)[1], g, acc)

    def last(self, params, stats, x, label, weight, denom, acc, z_sum, sums):
        """The last stage on one micro-batch: forward, loss over the global denominator,
        backward; accumulates its gradients, statistics and metric sums."""
        S = self.stages

        def loss(p, h):
            logits, new = self.forward(S - 1, p, stats, h, True)
            value, s_m = steplib.loss_from_logits(logits, {"label": label, "weight": weight}, denom)
            return value, (s_m, new)

        argnums = (0,) if S == 1 else (0, 1)
        grads, (s_m, new) = jax.grad(loss, argnums, has_aux=True)(params, x)
        add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
        return add(acc, grads[0]), (grads[1] if S > 1 else None), add(z_sum, new), add(sums, s_m)

    # --- the backward in two: input gradient, then weight gradient (layer by layer) ---------
    def _layer(self, s, i, params, stats, h):
        """Layer i of stage s on `h` (stage 0's first layer takes the normalised images):
        its output and its batch-norm statistics after the call."""
        zeros = lambda t: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), t)  # noqa: E731
        model = nnx.merge(self.graphdef, pick(self.shapes, [params, zeros(self.shapes)]),
                          pick(self.state_shapes, [stats, zeros(self.state_shapes)]))
        layer = model.layers()[i]
        out = layer(h, True)
        return out, layout.owned(nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param))), list(layer.keys))

    def layers_forward(self, s, params, stats, x, z_sum):
        """(output, each layer's vjp, z_sum + the stage's statistics)."""
        h = steplib.normalize(x) if s == 0 else x
        vjps, new = [], []
        for i in self.ranges[s]:
            h, vjp, z_i = jax.vjp(lambda p, a, i=i: self._layer(s, i, p, stats, a), params, h, has_aux=True)
            vjps.append(vjp)
            new += layout.leaves(z_i)
        return h, vjps, jax.tree.map(jnp.add, z_sum, layout.nest(new)) if new else z_sum

    @staticmethod
    def backward_input(vjps, g):
        """The stage's input gradient from its output's `g`, and per layer what
        `backward_weight` needs (its output cotangent and the values of its backward that the
        input gradient computed: `split_backward`)."""
        kept = []
        for vjp in reversed(vjps):
            g, k = split_backward.input_half(vjp, g)
            kept.append(k)
        return g, kept[::-1]

    @staticmethod
    def backward_weight(vjps, kept, acc):
        """acc + the stage's parameter gradients from its layers' vjps and what
        `backward_input` kept of each."""
        for vjp, k in zip(vjps, kept):
            acc = jax.tree.map(jnp.add, acc, split_backward.weight_half(vjp, k))
        return acc

    def last_input(self, params, stats, x, label, weight, denom, z_sum, sums):
        """The last stage on one micro-batch: forward, loss over the global denominator and
        the input gradient; returns (input gradient, layers' vjps, their cotangents, z_sum,
        sums) for `backward_weight`."""
        S = self.stages
        logits, vjps, z_sum = self.layers_forward(S - 1, params, stats, x, z_sum)
        value = lambda lg: steplib.loss_from_logits(lg, {"label": label, "weight": weight}, denom)  # noqa: E731
        _, loss_vjp, s_m = jax.vjp(value, logits, has_aux=True)
        g = loss_vjp(jnp.ones((), jnp.float32))[0]
        dx, cotangents = self.backward_input(vjps, g)
        return (dx if S > 1 else None), vjps, cotangents, z_sum, jax.tree.map(jnp.add, sums, s_m)

    def last_eval(self, params, stats, x, batch):
        """The last stage's metric sums on an evaluation batch."""
        return steplib.loss_from_logits(self.forward(self.stages - 1, params, stats, x, False)[0], batch)[1]

    def update(self, params, opt_state, grads, z_sum):
        """The optimizer update of a stage's parameters; its statistics the micro-batches' mean."""
        st = steplib.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                                opt_state=opt_state, model_state={})
        st = steplib.apply_update(st, grads, self.tx)
        return st.params, st.opt_state, jax.tree.map(lambda z: z / self.microbatches, z_sum)

    # --- accumulators and micro-batches ------------------------------------------------------
    def zeros(self, s, params, stats):
        """Zero accumulators of stage s: gradients, statistics (and metric sums on the last)."""
        sums = {k: jnp.zeros((), jnp.float32) for k in steplib.SUMS} if s == self.stages - 1 else None
        zero = lambda t: jax.tree.map(jnp.zeros_like, t)  # noqa: E731
        return zero(params), zero(stats), sums

    def split_images(self, r, x):
        return tuple(jnp.split(self._rows(r, x), self.microbatches // self.replicas))

    def split_labels(self, r, label, weight):
        """Replica r's micro-batches of labels and weights, and the global batch's weight total."""
        cut = lambda a: tuple(jnp.split(self._rows(r, a), self.microbatches // self.replicas))  # noqa: E731
        return cut(label), cut(weight), weight.sum()

    def _rows(self, r, a):
        n = a.shape[0] // self.replicas
        return a[r * n:(r + 1) * n]
