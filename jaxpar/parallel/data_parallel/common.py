"""What every data-parallel strategy shares: mesh, padded batches, denominator, accumulation.

The data mesh, batch placement with padding, the global loss denominator and gradient
accumulation.

Uneven global batches (100 examples on 8 devices) are padded to a multiple of the device
count with weight-0 rows. Every shard divides its weighted loss by the *global* weight
total, so each shard's gradient is its |B_i|/|B| share and their sum is exactly the
gradient of the unpadded global batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.parallel.data_parallel import cost
from jaxpar import mesh as meshlib
from jaxpar.profiling import measure
from jaxpar import step as steplib
from jaxpar.parallel import layout
from jaxpar.parallel.base import Strategy
from jaxpar.errors import ConfigError


class DataParallel(Strategy):
    """Base for strategies that split the batch over the DATA axis."""

    cost_model = staticmethod(cost.data_parallel)

    family = "data parallel"
    default_axes = {meshlib.DATA: -1}
    options = ("accumulate", "steps_per_dispatch")

    def _setup(self, model, tx, mesh):
        """Common part of `init`: remember mesh and optimizer, split the model."""
        self.mesh, self.tx = mesh, tx
        self.n = mesh.shape[meshlib.DATA]
        self.k = self.config.parallel.accumulate
        if self.k < 1:
            raise ConfigError(f"--accumulate must be >= 1, got {self.k}")
        self.replicated = NamedSharding(mesh, P())
        self.batch_sharding = NamedSharding(mesh, P(meshlib.DATA))
        self.graphdef, params, model_state = steplib.split_model(model)
        self.template = layout.abstract(params)
        return params, model_state

    def rows_multiple(self) -> int:
        return self.n * self.k  # devices x accumulation chunks

    def padded_size(self, batch_size: int) -> int:
        """Rows per global batch after padding (weight-0 rows change neither loss nor gradient)."""
        return -(-batch_size // self.rows_multiple()) * self.rows_multiple()

    def place_batch(self, batch):
        batch = self.pad(batch)
        if jax.process_count() > 1:  # jax.distributed: each process places only its own rows
            return jax.tree.map(self._process_local, batch)
        return jax.device_put(batch, self.batch_sharding)

    def _process_local(self, rows):
        """This process's contiguous share of a global host array, made part of the global one."""
        per = len(rows) // jax.process_count()
        mine = rows[jax.process_index() * per:(jax.process_index() + 1) * per]
        return jax.make_array_from_process_local_data(self.batch_sharding, mine, rows.shape)

    def state_from_reference(self, ref):
        return jax.device_put(ref, self.replicated)

    def describe(self) -> dict:
        return {**super().describe(), "axes": {meshlib.DATA: "batch"},
                "accumulate": self.config.parallel.accumulate}

    def theory(self) -> dict[str, int]:
        """One all-reduce of the gradient per step, plus the loss denominator and two metric
        sums (3 f32 scalars). A ring all-reduce moves 2(N-1)/N of it per device."""
        grad = measure.tree_bytes(self.template)
        return {"all-reduce": grad + 12, "total": grad + 12,
                "ring_bytes_per_device": int(2 * (self.n - 1) / self.n * grad)}


def accumulated_grads(params, graphdef, model_state, batch, denom, k: int):
    """Gradient of the (shard of the) batch, computed in `k` sequential chunks.

    Chunk j holds rows j, j+k, j+2k, ... (strided, so every device keeps an equal share of
    every chunk). Each chunk divides by the same `denom`, so the chunk gradients add up to
    the whole batch's gradient: accumulation changes memory, not the result.

    Returns:
      (grads, (model_state, metric_sums))
    """
    if k == 1:
        return steplib.grad_fn(params, graphdef, model_state, batch, denom)
    rows = batch["label"].shape[0]
    if rows % k:
        raise ConfigError(f"--accumulate {k} does not divide the {rows} rows each device gets; "
                          "change --accumulate or --batch-size")
    chunks = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(rows // k, k, *x.shape[1:]), 0, 1), batch)

    def one_chunk(carry, chunk):
        grads, state, sums = carry
        g, (state, s) = steplib.grad_fn(params, graphdef, state, chunk, denom)
        return (jax.tree.map(jnp.add, grads, g), state, jax.tree.map(jnp.add, sums, s)), None

    # The first chunk seeds the carry, so its types (incl. shard_map's varying axes) match.
    first = jax.tree.map(lambda x: x[0], chunks)
    grads, (model_state, sums) = steplib.grad_fn(params, graphdef, model_state, first, denom)
    rest = jax.tree.map(lambda x: x[1:], chunks)
    carry = (grads, model_state, sums)
    if jax.default_backend() == "cpu":
        # A Python loop on CPU: XLA:CPU runs convolutions inside any while loop on a slow path
        # (the CNN's 2 chunks: 404 ms in a scan, even unroll=True, which keeps a 1-trip loop;
        # 29 ms written out). Elsewhere a scan, which keeps one chunk's activations at a time.
        for j in range(k - 1):
            carry, _ = one_chunk(carry, jax.tree.map(lambda x: x[j], rest))
    else:
        carry, _ = jax.lax.scan(one_chunk, carry, rest)
    grads, model_state, sums = carry
    return grads, (model_state, sums)


def global_sums(sums, denom):
    """Metric sums over all shards. `count` is the weight total already all-reduced as the
    loss denominator, so only loss and accuracy sums travel (one all-reduce fewer)."""
    summed = jax.lax.psum({"loss_sum": sums["loss_sum"], "correct": sums["correct"]}, meshlib.DATA)
    return {**summed, "count": denom}
