"""`hybrid` with one program per stage, each on its own data x tensor sub-mesh (`--pipeline-impl mpmd`).

The host-driven pipeline (`host_pipeline.HostPipeline`: per-stage programs, the GPipe or
1F1B table walked from the host, asynchronous dispatch) where a stage is not one device but
the stage's slice of the mesh, DATA x TENSOR. Inside a stage the programs are plain `jit`
over arrays laid out on that sub-mesh: the parameters by the Megatron specs `tensor` uses
(`tensor.param_specs`, optimizer moments following their parameters), the rows of every
micro-batch over DATA; XLA places the collectives of the split (as in `tensor-auto`) and the
sum of the gradients over DATA. Micro-batch m takes the m-th 1/M of every data shard's rows,
so cutting micro-batches moves nothing between devices. Activations cross to the next stage
with `device_put` onto its sub-mesh.

Why: the SPMD formulation's collectives (a permute per slot, the split's all-reduces) each
wait for every device of the mesh; with more simulated devices than cores each wait costs a
scheduling round, and stack-mlp's step on 4 devices took ~0.9 s against `single`'s 17 ms.

Within one process (stages on several processes: the SPMD formulation).

    python -m experiments bench --model stack-mlp --strategy hybrid --devices 4 \\
        --mesh tensor=2,stage=2 --microbatches 8 --pipeline-impl mpmd
"""

from __future__ import annotations

import math

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar.mesh import DATA, STAGE
from jaxpar.parallel.tensor import tensor
from jaxpar.parallel.pipeline.common import HybridFace
from jaxpar.parallel.pipeline.mpmd import PipelineMPMD


class HybridMPMD(HybridFace, PipelineMPMD):
    implementation = "mpmd"
    cuts_inside_layers = False  # its stages' tensor split is per layer of the model's own

    def _stage_devices(self, mesh) -> list:
        """Each stage's sub-mesh (the mesh without its STAGE axis, at that stage's index);
        a stage is named by its sub-mesh's first device."""
        axis = mesh.axis_names.index(STAGE)
        names = tuple(a for a in mesh.axis_names if a != STAGE)
        self.submeshes = [Mesh(np.take(mesh.devices, s, axis=axis), names)
                          for s in range(mesh.devices.shape[axis])]
        self.data = dict(zip(mesh.axis_names, mesh.devices.shape))[DATA]
        return [sub.devices.flat[0] for sub in self.submeshes]

    def rows_multiple(self) -> int:
        return self.data

    # --- layouts on a stage's sub-mesh -----------------------------------------------------
    def _shardings(self, tree, s: int, kind: str):
        sub = self.submeshes[s]
        if kind == "params":
            specs = tensor.param_specs(tree)
        elif kind == "opt":  # moments follow their parameters, counts replicated
            pspecs = tensor.param_specs(self._stage_params(self.shapes, s))
            specs = optax.tree_map_params(self.tx, lambda _, spec: spec, tree, pspecs,
                                          transform_non_params=lambda _: P(),
                                          is_leaf=lambda x: isinstance(x, P))
        else:  # 'rows': split over DATA along the batch; 'stats' and scalars replicated
            specs = jax.tree.map(lambda a: P(DATA) if kind == "rows" and np.ndim(a) else P(), tree)
        return jax.tree.map(lambda spec: NamedSharding(sub, spec), specs,
                            is_leaf=lambda x: isinstance(x, P))

    def _place(self, tree, s, r, kind):
        return jax.device_put(tree, self._shardings(tree, s, kind))

    def move(self, tree, s, r=0):
        return jax.device_put(tree, self._shardings(tree, s, "rows"))

    def abstract_on(self, tree, s, r=0):
        """Arguments of stage s: a leaf already laid out on its sub-mesh keeps its layout
        (parameters, accumulators, residuals); one arriving from elsewhere is rows."""
        here = set(self.submeshes[s].devices.flat)

        def one(a):
            keep = getattr(a, "sharding", None) is not None and set(a.sharding.device_set) == here
            sharding = a.sharding if keep else self._shardings(a, s, "rows")
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
        return jax.tree.map(one, tree)

    # --- micro-batches: the m-th 1/M of every data shard, so nothing moves ---------------------
    def _micro(self, a, s: int) -> tuple:
        d, b = self.data, a.shape[0] // (self.data * self.M)
        parts = a.reshape(d, self.M, b, *a.shape[1:])
        rows = NamedSharding(self.submeshes[s], P(DATA))
        return tuple(jax.lax.with_sharding_constraint(parts[:, m].reshape(d * b, *a.shape[1:]), rows)
                     for m in range(self.M))

    def _split_images(self, r, x):
        return self._micro(x, 0)

    def _split_labels(self, r, label, weight):
        return self._micro(label, self.S - 1), self._micro(weight, self.S - 1), weight.sum()

    def _zeros(self, s, params, stats):
        acc, z, sums = super()._zeros(s, params, stats)
        return jax.lax.with_sharding_constraint(acc, self._shardings(acc, s, "params")), z, sums

    # --- accounting ------------------------------------------------------------------------
    def stage_param_bytes(self) -> list[int]:
        """Parameter bytes per device of each stage: split leaves 1/T, the rest whole."""
        def local(a, sharding):
            return math.prod(sharding.shard_shape(a.shape)) * a.dtype.itemsize
        out = []
        for s in range(self.S):
            p = self._stage_params(self.shapes, s)
            out.append(int(sum(jax.tree.leaves(jax.tree.map(local, p, self._shardings(p, s, "params"))))))
        return out

    def theory(self) -> dict[str, int]:
        return {}  # measured only: XLA places the split's collectives within a stage

    def describe(self) -> dict:
        return {**super().describe(), **self.mesh_facts(),
                "within_stage": "jit over the stage's data x tensor sub-mesh (XLA's collectives)"}
