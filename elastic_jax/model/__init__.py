"""Pure-functional Nemotron-H blocks and the full model (`init`, `apply`)."""
from elastic_jax.model.model import apply, apply_cached, init, init_cache, param_shapes  # noqa: F401
