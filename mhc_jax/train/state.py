"""The training state (a pytree) and its sharded creation under ``jax.jit``."""

from __future__ import annotations

import functools
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from mhc_jax.train import sharding as sh


@flax.struct.dataclass
class State:
  step: jax.Array  # number of updates applied (int32)
  params: Any  # unboxed parameter pytree
  opt_state: Any
  nonfinite: jax.Array  # number of skipped non-finite updates (int32)


def abstract_boxed(model, example_tokens, tx):
  """Shapes (with logical-axis boxes) of the parameters and the optimiser state."""
  params = param_shapes(model, jax.ShapeDtypeStruct(example_tokens.shape, example_tokens.dtype))
  return params, jax.eval_shape(tx.init, params)


@functools.lru_cache(maxsize=64)
def param_shapes(model, tokens: jax.ShapeDtypeStruct):
  """The boxed parameter shapes of ``model.init`` on tokens of that shape, traced once per
  (model, shape) in a process (flax modules hash by their fields, so an equal model is a hit)."""
  init = lambda: model.init(jax.random.PRNGKey(0), jnp.zeros(tokens.shape, tokens.dtype))
  return jax.eval_shape(init)


def state_shardings(model, example_tokens, tx, mesh) -> State:
  params, opt = abstract_boxed(model, example_tokens, tx)
  rep = sh.replicated(mesh)
  return State(
    step=rep, params=sh.shardings(params, mesh), opt_state=sh.shardings(opt, mesh), nonfinite=rep
  )


def init_fn(model, example_tokens, tx):
  """``key -> State``: a fresh state (to be jitted into its shardings)."""

  def init(key):
    params = nn.meta.unbox(model.init(key, example_tokens))
    return State(
      step=jnp.zeros((), jnp.int32),
      params=params,
      opt_state=tx.init(params),
      nonfinite=jnp.zeros((), jnp.int32),
    )

  return init


def create_state(model, example_tokens, tx, mesh, seed: int) -> tuple[State, State]:
  """(state, its shardings): initialised directly into its shards with ``jit(out_shardings)``."""
  shard = state_shardings(model, example_tokens, tx, mesh)
  state = jax.jit(init_fn(model, example_tokens, tx), out_shardings=shard)(jax.random.PRNGKey(seed))
  return state, shard


def abstract_state(shard: State, model, example_tokens, tx) -> State:
  """ShapeDtypeStructs with shardings: what a checkpoint is restored into."""
  params, opt = abstract_boxed(model, example_tokens, tx)
  i32 = jax.ShapeDtypeStruct((), jnp.int32)
  shapes = State(
    step=i32, params=nn.meta.unbox(params), opt_state=nn.meta.unbox(opt), nonfinite=i32
  )
  return jax.tree.map(
    lambda s, d: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=d), shapes, shard
  )
