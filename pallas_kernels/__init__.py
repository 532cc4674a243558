"""Pallas kernels (Mamba-2 SSD scan, grouped MoE matmul), each with a pure-jnp reference.

No kernel has landed yet: the model runs the pure-jnp paths in `elastic_jax.model.ssd`
(chunked SSD) and `elastic_jax.model.moe` (dense / `jax.lax.ragged_dot` dispatch).
"""
