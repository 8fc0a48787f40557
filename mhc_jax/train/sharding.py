"""The device mesh, the logical-axis rules table, and placement of parameters and batches.

Mesh axes: ``data`` (pure data parallel), ``fsdp`` (data parallel with parameters sharded over
it), ``tensor`` (model parallel over heads / MLP hidden / vocab). Parameters carry logical names
(``embed``, ``mlp``, ``heads``, ``kv``, ``vocab``, ``layers``, ``streams``); ``RULES`` maps them
to mesh axes. A dimension that does not divide evenly over its mesh axes is replicated.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from mhc_jax.train.config import MeshConfig, validate_mesh

AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")
RULES = (
  ("embed", "fsdp"),
  ("streams_embed", "fsdp"),
  ("mlp", "tensor"),
  ("heads", "tensor"),
  ("vocab", "tensor"),
  ("kv", None),
  ("layers", None),
  ("streams", None),
)


def make_mesh(
  mesh_cfg: MeshConfig, batch_size: int | None = None, devices=None
) -> jax.sharding.Mesh:
  """A (data, fsdp, tensor) mesh over all (or the given) devices; sizes validated first."""
  devices = jax.devices() if devices is None else devices
  shape = validate_mesh(mesh_cfg, len(devices), batch_size)
  return jax.make_mesh(shape, AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=devices)


def fit_spec(spec: P, shape, mesh) -> P:
  """Drop mesh axes from dimensions they do not divide (those dimensions are replicated)."""
  out = []
  for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    size = int(np.prod([mesh.shape[a] for a in names])) if names else 1
    out.append(axes if dim % size == 0 else None)
  return P(*out)


def shardings(abstract_tree, mesh) -> object:
  """NamedShardings for a (possibly boxed) abstract pytree from its logical axis names. An
  empty node under a box (optax's MaskedNode: per-role Adam state) stays as it is."""
  specs = nn.get_partition_spec(abstract_tree)
  mesh_specs = nn.logical_to_mesh(specs, RULES)
  return jax.tree.map(
    lambda s, a: NamedSharding(mesh, fit_spec(s, a.shape, mesh)) if hasattr(a, "shape") else a,
    mesh_specs,
    nn.meta.unbox(abstract_tree),
    is_leaf=lambda x: isinstance(x, P),
  )


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def put_batch(batch: dict, mesh, stacked: bool = False) -> dict:
  """Place a host batch (this process's rows) as global arrays sharded over the batch axes
  (``stacked``: behind a leading, unsharded member axis ``[P, B, ...]``)."""
  spec = P(None, BATCH) if stacked else P(BATCH)
  n_proc = jax.process_count()

  def put(x):
    x = np.asarray(x)
    if n_proc == 1:
      return jax.device_put(x, NamedSharding(mesh, fit_spec(spec, x.shape, mesh)))
    shape = list(x.shape)
    shape[int(stacked)] *= n_proc
    return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), x, tuple(shape))

  return {k: put(v) for k, v in batch.items()}


def local_rows(batch: dict) -> dict:
  """This process's slice of a globally generated batch (rows split evenly over processes)."""
  n, i = jax.process_count(), jax.process_index()
  if n == 1:
    return batch
  return {k: np.asarray(v)[i * (len(v) // n) : (i + 1) * (len(v) // n)] for k, v in batch.items()}
