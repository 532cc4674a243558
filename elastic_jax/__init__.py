"""elastic-jax: nested many-in-one hybrid Mamba-2 / attention / MoE language models in JAX."""
from elastic_jax.config import ModelConfig  # noqa: F401
from elastic_jax.elastic.masks import BudgetMasks, from_counts  # noqa: F401
from elastic_jax.elastic.params_count import count_params  # noqa: F401
from elastic_jax.model import ElasticLM, apply, init, logical_axes, param_shapes  # noqa: F401

__version__ = "0.2.0"
