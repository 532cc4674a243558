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


def test_box_fingerprints_are_the_fingerprints_of_each_prefix_box():
  """One prefix-sum pass gives every box's sums, equal to the box read on its own, for 32-, 16-
  and 64-bit elements; a changed element inside a box changes it, one outside does not."""
  x = jax.random.normal(jax.random.PRNGKey(0), (6, 5, 4))
  shapes = [(6, 5, 4), (3, 5, 2), (1, 1, 1), (4, 2, 4)]
  for arr in (x, x.astype(jnp.bfloat16), np.asarray(x, np.float64)):
    got = fingerprint.box_fingerprints({"x": arr}, {"x": shapes})["x"]
    for s in shapes:
      assert got[",".join(map(str, s))] == fingerprint.box_fingerprint(
          arr[:s[0], :s[1], :s[2]]), s
  inside, outside = x.at[2, 1, 1].add(1.0), x.at[5, 4, 3].add(1.0)
  box = x[:3, :5, :2]
  assert fingerprint.box_fingerprint(inside[:3, :5, :2]) != fingerprint.box_fingerprint(box)
  assert fingerprint.box_fingerprint(outside[:3, :5, :2]) == fingerprint.box_fingerprint(box)


def test_box_fingerprints_host_and_device_paths_agree(monkeypatch):
  """Small arrays are summed in numpy on the host, large or sharded ones on device: the same
  modular sums either way."""
  x = jax.random.normal(jax.random.PRNGKey(1), (7, 3, 5)).astype(jnp.bfloat16)
  shapes = [(7, 3, 5), (2, 3, 1)]
  host = fingerprint.box_fingerprints({"x": x}, {"x": shapes}), fingerprint.box_fingerprint(x)
  monkeypatch.setattr(fingerprint, "HOST_MAX", 0)
  device = fingerprint.box_fingerprints({"x": x}, {"x": shapes}), fingerprint.box_fingerprint(x)
  assert host == device
