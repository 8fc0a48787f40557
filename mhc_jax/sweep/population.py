"""Populations: runs that differ only in ``optim.lr``, ``train.seed`` and/or ``model.init_scale``
trained together as one jitted program, ``jax.vmap`` over parameters and optimiser state, by the
engine of a single run (``train.loop.run_members``); docs/interfaces.md, "Training engine".
"""

from __future__ import annotations

import dataclasses
import json
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from mhc_jax import logs
from mhc_jax.model import Transformer
from mhc_jax.train import sharding as sh
from mhc_jax.train.config import Config, ConfigError, to_dict
from mhc_jax.train.loop import Program, Setup, host_batch, run_members
from mhc_jax.train.optim import make_optimizer
from mhc_jax.train.state import State, init_fn, state_shardings
from mhc_jax.train.step import locate_nonfinite, make_eval_step, make_loss, make_train_step

# -------------------------------------------------------------------------- Who can be a population
#: Axes that leave every shape alone, so runs differing only in them can share one program.
POPULATION_KEYS = ("optim.lr", "train.seed", "model.init_scale")


def _shared_dict(cfg: Config) -> dict:
  d = to_dict(cfg)
  d.pop("dist", None)
  d.pop("name", None)
  for key in POPULATION_KEYS:
    sec, field = key.split(".")
    d[sec].pop(field, None)
  return d


def shared_key(cfg: Config) -> str:
  """What members of one population must share: the config without the population keys."""
  return json.dumps(_shared_dict(cfg), sort_keys=True, default=str)


def check_members(cfgs: Sequence[Config]) -> None:
  """ConfigError naming the first key (other than the population keys) where members differ."""
  ref = logs.flatten_dict(_shared_dict(cfgs[0]))
  for c in cfgs[1:]:
    other = logs.flatten_dict(_shared_dict(c))
    for k in sorted(set(ref) | set(other)):
      if ref.get(k) != other.get(k):
        raise ConfigError(
          f"{k}: population members differ ({ref.get(k)!r} vs {other.get(k)!r});"
          f" only {', '.join(POPULATION_KEYS)} may vary within a population"
        )


# ---------------------------------------------------------------------------- The compiled programs
@dataclasses.dataclass
class Programs:
  model: Transformer
  example: jax.Array
  tx: object  # the optimiser at the config's lr (shapes, restores)
  shard: State  # one member's shardings (as a separate run's)
  pop_shard: State  # the same with a leading unsharded member axis
  step: object  # (state, lrs, active, batch, diag) -> (state, metrics)
  eval: object  # (params, batch) -> metrics
  take: object  # (state, i) -> member i's state
  stack: object  # [member states] -> state
  _inits: dict = dataclasses.field(default_factory=dict)

  def init(self, cfg: Config):
    """One member's fresh state (as create_state makes it), compiled once per init_scale."""
    scale = cfg.model.init_scale
    if scale not in self._inits:
      self._inits[scale] = jax.jit(
        init_fn(Transformer(cfg.model), self.example, self.tx), out_shardings=self.shard
      )
    return self._inits[scale](jax.random.PRNGKey(cfg.train.seed))

  def init_all(self, cfgs: Sequence[Config]):
    """The population's fresh state: one vmapped init over the members' keys when they share
    model.init_scale (the same numbers as each member's own init), else member by member."""
    if len({c.model.init_scale for c in cfgs}) > 1:
      return self.stack([self.init(c) for c in cfgs])
    if "all" not in self._inits:
      self._inits["all"] = jax.jit(
        jax.vmap(init_fn(Transformer(cfgs[0].model), self.example, self.tx)),
        out_shardings=self.pop_shard,
      )
    keys = jnp.stack([jax.random.PRNGKey(c.train.seed) for c in cfgs])
    return self._inits["all"](keys)


_CACHE: dict = {}


def _member(tree, i: int):
  """Member ``i`` of a tree stacked along a leading member axis."""
  return jax.tree.map(lambda a: a[i], tree)


def programs(cfg: Config, mesh, size: int, stacked_batch: bool) -> Programs:
  """The population's jitted functions for `cfg`'s shapes (cached)."""
  key = (shared_key(cfg), size, stacked_batch, mesh)
  if key in _CACHE:
    return _CACHE[key]
  steps = cfg.train.steps
  model = Transformer(cfg.model)
  example = jnp.zeros((1, cfg.data.seq_len), jnp.int32)
  tx, _ = make_optimizer(cfg.optim, steps, model=cfg.model)
  shard = state_shardings(model, example, tx, mesh)
  pop_shard = jax.tree.map(lambda s: NamedSharding(mesh, P(None, *s.spec)), shard)
  rep = sh.replicated(mesh)
  b_axis = 0 if stacked_batch else None

  def member_step(state, lr, batch, diag):
    m_tx, m_schedule = make_optimizer(cfg.optim, steps, lr=lr, model=cfg.model)
    return make_train_step(model, m_tx, m_schedule, cfg, locate=False)(state, batch, diag)

  def pop_step(state, lrs, active, batch, diag):
    new, metrics = jax.vmap(lambda s, lr, b: member_step(s, lr, b, diag), in_axes=(0, 0, b_axis))(
      state, lrs, batch
    )
    freeze = lambda n, o: jnp.where(active.reshape((-1,) + (1,) * (n.ndim - 1)), n, o)
    if cfg.train.diag_every and not diag:  # a cond outside the vmap: only when a member fails
      loss = make_loss(model, cfg)
      loc = jax.vmap(lambda p, b: locate_nonfinite(loss, cfg, p, b), in_axes=(0, b_axis))
      none = lambda: jnp.full((len(lrs), 2), -1, jnp.int32)
      ok = jnp.all(metrics["finite"] | ~active)
      metrics["nonfinite_at"] = jax.lax.cond(ok, none, lambda: loc(state.params, batch))
    return jax.tree.map(freeze, new, state), metrics

  evaluate = jax.vmap(make_eval_step(model, cfg), in_axes=(0, b_axis))
  prog = Programs(
    model=model,
    example=example,
    tx=tx,
    shard=shard,
    pop_shard=pop_shard,
    step=jax.jit(pop_step, static_argnums=4, donate_argnums=0, out_shardings=(pop_shard, rep)),
    eval=jax.jit(evaluate, out_shardings=rep),
    take=jax.jit(_member, out_shardings=shard),
    stack=jax.jit(lambda ss: jax.tree.map(lambda *a: jnp.stack(a), *ss), out_shardings=pop_shard),
  )
  if len(_CACHE) >= 8:
    _CACHE.pop(next(iter(_CACHE)))
  _CACHE[key] = prog
  return prog


def put_batches(batches: list[dict], mesh, stacked: bool) -> dict:
  """Host batches (this process's rows) on the mesh: one shared batch, or stacked [P, B, ...]."""
  if stacked:
    batches = [{k: np.stack([np.asarray(b[k]) for b in batches]) for k in batches[0]}]
  return sh.put_batch(batches[0], mesh, stacked)


# ------------------------ Training: the population as the engine's program (train.loop.run_members)
class PopulationProgram(Program):
  """The members' state stacked along a leading axis, stepped as one vmapped program."""

  def __init__(self, setups: Sequence[Setup]):
    self.cfgs = [s.cfg for s in setups]
    check_members(self.cfgs)
    self.cfg, self.mesh, self.n = self.cfgs[0], setups[0].mesh, len(setups)
    self.stacked = len({c.train.seed for c in self.cfgs}) > 1
    self.sources = [s.source for s in setups] if self.stacked else [setups[0].source]
    p = self.prog = programs(self.cfg, self.mesh, self.n, self.stacked)
    self.model, self.example, self.tx, self.shard = p.model, p.example, p.tx, p.shard
    self._eval = p.eval
    self._rep = sh.replicated(self.mesh)
    self.lrs = jax.device_put(np.asarray([c.optim.lr for c in self.cfgs], np.float32), self._rep)

  def init(self):
    return self.prog.init_all(self.cfgs)

  def stack(self, members):
    return self.prog.stack(members)

  def member(self, state, i: int):
    return self.prog.take(state, i)

  def batch(self, step: int, split: str = "train"):
    return put_batches(
      [host_batch(s, self.cfg, step, split) for s in self.sources], self.mesh, self.stacked
    )

  def step(self, state, active, step: int, diag: bool):
    return self.prog.step(
      state, self.lrs, jax.device_put(active, self._rep), self.batch(step), diag
    )

  def to_host(self, tree) -> dict:
    return {k: np.asarray(v) for k, v in jax.device_get(tree).items()}


def train_population(
  setups: Sequence[Setup], run_dirs: Sequence, resume: bool = True, progress: bool = True
) -> list:
  """Train the members (prepared setups) as one program, each logged into its run directory;
  returns and raises as ``train.loop.run_members``."""
  program = PopulationProgram(setups)
  members = [str(d) for d in run_dirs]
  extra = [
    {"population": {"size": program.n, "index": i, "members": members}} for i in range(program.n)
  ]
  return run_members(program, program.cfgs, run_dirs, resume=resume, progress=progress, extra=extra)
