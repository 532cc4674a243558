"""Device meshes and shardings: arrays are sharded by the logical axis names the model declares."""
