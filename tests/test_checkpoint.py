"""Checkpoints of sharded state on the test session's 8 CPU devices (one process)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from mhc_jax.train.checkpoint import Checkpoints

COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
  lambda event, secs, **kw: (
    COMPILES.append(event) if event.endswith("backend_compile_duration") else None
  )
)


def test_a_sharded_save_compiles_nothing_and_restores_every_shard(tmp_path):
  """Orbax's replica-parallel default cut each replicated shard on its device with a compiled
  slice per device and shape; one process holds every replica, so a save now compiles none."""
  mesh = jax.make_mesh((2, 4), ("rep", "shard"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  spec = NamedSharding(mesh, P(None, "shard"))  # 4 shards, each replicated on 2 devices
  state = {
    "w": jax.device_put(jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16), spec),
    "b": jax.device_put(jnp.ones((3, 8), jnp.float32), spec),
  }
  jax.block_until_ready(state)
  ck = Checkpoints(tmp_path / "ck", keep=2, async_save=False)
  COMPILES.clear()
  ck.save(1, state, {"note": "x"}, force=True)
  ck.wait()
  assert COMPILES == [], f"{len(COMPILES)} programs compiled by a save"
  target = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state
  )
  got, host = ck.restore(target)
  ck.close()
  assert host == {"note": "x"}
  for k in state:
    assert got[k].sharding == state[k].sharding
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(state[k]))
