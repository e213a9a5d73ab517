"""Data parallelism: `dp-pmap`, `dp-shard-map`, `dp-auto`, `fsdp`, `local-sgd`; what they share
(`common`: the data mesh, padded batches, the global denominator, accumulation) and what they
cost (`cost`)."""
