"""Kernels for the two hot spots, selected by `ModelConfig.kernels` ("xla" | "pallas").

- `ssd`: the Mamba-2 chunked SSD forward and backward as Pallas kernels (Triton on GPU, Mosaic
  on TPU, Pallas' interpreter on CPU); reference: `elastic_jax.model.ssd`.
- `gmm`: the MoE grouped matmul, dispatched to the shipped kernel of each platform (megablox on
  TPU, tokamax on GPU); reference and CPU path: `jax.lax.ragged_dot`.
This package imports nothing from `elastic_jax`: the model imports it.
"""
