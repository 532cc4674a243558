"""ml_collections / ModelConfig presets: `tiny` (CPU default), `reasoning` (tiny on a
reasoning-heavy mix, trained longer) and `nano_v3` (30B-A3B shape)."""
import importlib

from elastic_jax.config import ModelConfig


def model_config(name: str) -> ModelConfig:
  """The `ModelConfig` of preset `name` (a module in this package)."""
  try:
    mod = importlib.import_module(f"configs.{name}")
  except ModuleNotFoundError:
    raise ValueError(
        f"unknown config {name!r}; allowed: ['tiny', 'nano_v3', 'reasoning']") from None
  return mod.MODEL
