"""Content fingerprints: exact under any sharding, sensitive to one changed element."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from elastic_jax.io import fingerprint


def test_same_under_sharding_changed_by_one_element():
  x = jax.random.normal(jax.random.PRNGKey(0), (64, 24))
  tree = {"w": x, "b": x[0].astype(jnp.bfloat16), "n": jnp.arange(5, dtype=jnp.int32)}
  ref = fingerprint.fingerprints(tree)
  assert set(ref) == {"['w']", "['b']", "['n']"} and all(len(v) == 2 for v in ref.values())
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
  sharded = dict(tree, w=jax.device_put(x, NamedSharding(mesh, P("d", None))))
  assert fingerprint.fingerprints(sharded) == ref
  for i, j in ((0, 0), (63, 23), (17, 5)):
    bumped = dict(tree, w=x.at[i, j].set(np.nextafter(np.float32(x[i, j]), np.float32(9))))
    assert fingerprint.mismatches(bumped, ref) == ["['w']"]
  swapped = dict(tree, w=x[::-1])   # same values, other places
  assert fingerprint.mismatches(swapped, ref) == ["['w']"]
  assert fingerprint.mismatches(tree, {"['w']": ref["['w']"]}) == []   # unrecorded leaves skip
