"""Where each stage copy's arrays live on a host-driven pipeline: a device each, or for
`hybrid` a data x tensor sub-mesh each (`SubMeshPlacement`).

    placement.device(s, r)            # the device of stage s of replica r (a sub-mesh's first)
    placement.place(tree, s, r, kind) # host arrays there ('params', 'opt', 'stats', 'rows')
    placement.move(x, s, r)           # an activation or gradient sent there
"""

from __future__ import annotations

import math

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from jaxpar.mesh import DATA, STAGE
from jaxpar.parallel.pipeline.schedules import Schedule
from jaxpar.parallel.tensor import tensor
from jaxpar.parallel.transport import processes


class Placement:
    """One device per stage position (every device of the mesh holds one)."""

    def __init__(self, mesh, schedule: Schedule):
        self.mesh, self.schedule = mesh, schedule
        self.devices = self.stage_devices(mesh)

    def stage_devices(self, mesh) -> list:
        return list(mesh.devices.flat)

    def rows_multiple(self) -> int:
        """What a placed batch's rows must be a multiple of."""
        return 1

    def device(self, s: int, r: int = 0):
        """The device of stage s of replica r."""
        return self.devices[self.schedule.device_of(s, r)]

    def place(self, tree, s: int, r: int, kind: str):
        """Host arrays of stage s of replica r on its device; `kind` ('params', 'opt',
        'stats', 'rows') says what they are, for placements that lay each out differently."""
        return processes.place(tree, SingleDeviceSharding(self.device(s, r)))

    def move(self, tree, s: int, r: int = 0):
        """Activations or their gradients sent to stage s of replica r."""
        return processes.move(tree, self.device(s, r))

    def abstract_on(self, tree, s: int, r: int = 0):
        """`tree`'s shapes as abstract arguments of a program of stage s of replica r."""
        sharding = SingleDeviceSharding(self.device(s, r))
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)

    def local_bytes(self, tree, s: int) -> int:
        """Bytes of stage s's parameter-shaped `tree` held by each of its devices."""
        return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))

    def one_device_per_stage(self) -> bool:
        return self.mesh.devices.size == len(self.devices) and len(set(self.devices)) == len(self.devices)


class SubMeshPlacement(Placement):
    """`hybrid`'s stages: each on the mesh without its STAGE axis at the stage's index (named
    by that sub-mesh's first device), parameters laid out by the Megatron specs `tensor` uses
    (optimizer moments following their parameters), rows split over DATA."""

    def __init__(self, mesh, schedule: Schedule, tx: optax.GradientTransformation, stage_shapes):
        self.tx, self.stage_shapes = tx, stage_shapes  # stage_shapes(s): stage s's parameter shapes
        super().__init__(mesh, schedule)

    def stage_devices(self, mesh) -> list:
        axis = mesh.axis_names.index(STAGE)
        names = tuple(a for a in mesh.axis_names if a != STAGE)
        self.submeshes = [Mesh(np.take(mesh.devices, s, axis=axis), names)
                          for s in range(mesh.devices.shape[axis])]
        self.data = dict(zip(mesh.axis_names, mesh.devices.shape))[DATA]
        return [sub.devices.flat[0] for sub in self.submeshes]

    def rows_multiple(self) -> int:
        return self.data

    def shardings(self, tree, s: int, kind: str):
        sub = self.submeshes[s]
        if kind == "params":
            specs = tensor.param_specs(tree)
        elif kind == "opt":  # moments follow their parameters, counts replicated
            pspecs = tensor.param_specs(self.stage_shapes(s))
            specs = optax.tree_map_params(self.tx, lambda _, spec: spec, tree, pspecs,
                                          transform_non_params=lambda _: P(),
                                          is_leaf=lambda x: isinstance(x, P))
        else:  # 'rows': split over DATA along the batch; 'stats' and scalars replicated
            specs = jax.tree.map(lambda a: P(DATA) if kind == "rows" and np.ndim(a) else P(), tree)
        return jax.tree.map(lambda spec: NamedSharding(sub, spec), specs,
                            is_leaf=lambda x: isinstance(x, P))

    def place(self, tree, s, r, kind):
        return jax.device_put(tree, self.shardings(tree, s, kind))

    def move(self, tree, s, r=0):
        return jax.device_put(tree, self.shardings(tree, s, "rows"))

    def abstract_on(self, tree, s, r=0):
        """Arguments of stage s: a leaf already laid out on its sub-mesh keeps its layout
        (parameters, accumulators, residuals); one arriving from elsewhere is rows."""
        here = set(self.submeshes[s].devices.flat)

        def one(a):
            keep = getattr(a, "sharding", None) is not None and set(a.sharding.device_set) == here
            sharding = a.sharding if keep else self.shardings(a, s, "rows")
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
        return jax.tree.map(one, tree)

    def local_bytes(self, tree, s: int) -> int:
        """Split leaves 1/T on each device, the rest whole."""
        def local(a, sharding):
            return math.prod(sharding.shard_shape(a.shape)) * a.dtype.itemsize
        return int(sum(jax.tree.leaves(jax.tree.map(local, tree, self.shardings(tree, s, "params")))))
