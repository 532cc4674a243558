"""Nemotron-H as Flax linen modules (`ElasticLM`, `Block`, mixers) and thin functional wrappers."""
from elastic_jax.model.lm import ElasticLM  # noqa: F401
from elastic_jax.model.model import (apply, apply_cached, init, init_cache, logical_axes,  # noqa: F401
                                     param_shapes)
