"""Tensor parallelism: `tensor` (explicit collectives) and `tensor-auto` (compiler-placed), the
Megatron split of blocks (`megatron`) and the channel split of convolutions (`channels`, its
collectives in two forms: `comm_forms`), and what they cost (`cost`)."""
