"""Populations: runs that differ only in ``optim.lr``, ``train.seed`` and/or ``model.init_scale``
trained together as one jitted program, ``jax.vmap`` over parameters and optimiser state.

The population step is ``train.step.make_train_step`` itself, vmapped: each member builds its
optimiser with ``make_optimizer(..., lr=<its traced lr>)``, so a member's update is exactly the
one its separate run would make (up to float rounding of a traced rather than constant lr).
The non-finite skip of the step (``jnp.where(finite, new, old)``) is per member under vmap,
and nothing in the step reduces over members, so a member that goes non-finite leaves the
others' numbers unchanged. A member halted by policy (``train.nonfinite=halt`` or
``train.halt_on_divergence``) is frozen (its state is no longer updated) while the others go on.

Members share one batch when they share ``train.seed`` (the data seed); otherwise each gets its
own batches, stacked along a leading member axis. Parameters and optimiser state carry a
leading, unsharded member axis on top of the run's own shardings (the config's mesh).

Every member is logged into its own run directory exactly as ``train.loop.train`` would log a
run (``config.yaml``, ``metrics.jsonl``, ``events.jsonl``, ``summary.json`` with an extra
``population`` field, ``checkpoints/`` holding that member's own state), so the report and the
notebooks cannot tell them apart and ``mhc-jax train --out MEMBER_DIR --resume`` can continue a
member alone. A population resumes from the newest checkpoint step all members have.

Compiled programs are cached per (shared config, population size, batch layout): populations
of the same shapes (another lr grid, other seeds) reuse them.
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
import signal
import time
from pathlib import Path
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from mhc_jax import logs, spikes
from mhc_jax.model import Transformer, count_params
from mhc_jax.sweep.grid import POPULATION_KEYS
from mhc_jax.train import sharding as sh
from mhc_jax.train.checkpoint import Checkpoints
from mhc_jax.train.config import Config, ConfigError, DistConfig, save_config, to_dict
from mhc_jax.train.loop import (Preempted, RunHalted, Setup, _due, _is_diag, _preemption_check,
                                host_batch, threading_main)
from mhc_jax.train.optim import make_optimizer
from mhc_jax.train.state import State, abstract_state, state_shardings
from mhc_jax.train.step import make_eval_step, make_train_step

__all__ = ["POPULATION_KEYS", "shared_key", "check_members", "Programs", "programs",
           "train_population"]


# ------------------------------------------------------------------------------------------
# Who can be a population.

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
        raise ConfigError(f"{k}: population members differ ({ref.get(k)!r} vs {other.get(k)!r});"
                          f" only {', '.join(POPULATION_KEYS)} may vary within a population")


# ------------------------------------------------------------------------------------------
# The compiled programs.

@dataclasses.dataclass
class Programs:
  model: Transformer
  example: jax.Array
  tx: object            # the optimiser at the config's lr (shapes, restores)
  shard: State          # one member's shardings (as a separate run's)
  pop_shard: State      # the same with a leading unsharded member axis
  mesh: object
  stacked_batch: bool
  step: object          # (state, lrs, active, batch, diag) -> (state, metrics)
  eval: object          # (params, batch) -> metrics
  take: object          # (state, i) -> member i's state
  stack: object         # [member states] -> state
  _inits: dict = dataclasses.field(default_factory=dict)

  def _init_fn(self, model_cfg):
    model = Transformer(model_cfg)

    def init(key):
      params = nn.meta.unbox(model.init(key, self.example))
      return State(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.tx.init(params),
                   nonfinite=jnp.zeros((), jnp.int32))

    return init

  def init(self, cfg: Config):
    """One member's fresh state (as create_state makes it), compiled once per init_scale."""
    scale = cfg.model.init_scale
    if scale not in self._inits:
      self._inits[scale] = jax.jit(self._init_fn(cfg.model), out_shardings=self.shard)
    return self._inits[scale](jax.random.PRNGKey(cfg.train.seed))

  def init_all(self, cfgs: Sequence[Config]):
    """The population's fresh state: one vmapped init over the members' keys when they share
    model.init_scale (the same numbers as each member's own init), else member by member."""
    if len({c.model.init_scale for c in cfgs}) > 1:
      return self.stack([self.init(c) for c in cfgs])
    if "all" not in self._inits:
      self._inits["all"] = jax.jit(jax.vmap(self._init_fn(cfgs[0].model)),
                                   out_shardings=self.pop_shard)
    keys = jnp.stack([jax.random.PRNGKey(c.train.seed) for c in cfgs])
    return self._inits["all"](keys)


_CACHE: dict = {}


def _batch_spec(stacked: bool, shape, mesh) -> NamedSharding:
  spec = P(None, sh.BATCH) if stacked else P(sh.BATCH)
  return NamedSharding(mesh, sh._fit(spec, shape, mesh))


def programs(cfg: Config, mesh, size: int, stacked_batch: bool) -> Programs:
  """The population's jitted functions for `cfg`'s shapes (cached)."""
  key = (shared_key(cfg), size, stacked_batch, mesh)
  if key in _CACHE:
    return _CACHE[key]
  steps = cfg.train.steps
  model = Transformer(cfg.model)
  example = jnp.zeros((1, cfg.data.seq_len), jnp.int32)
  tx, _ = make_optimizer(cfg.optim, steps)
  shard = state_shardings(model, example, tx, mesh)
  pop_shard = jax.tree.map(lambda s: NamedSharding(mesh, P(None, *s.spec)), shard)
  rep = sh.replicated(mesh)
  b_axis = 0 if stacked_batch else None

  def member_step(state, lr, batch, diag):
    m_tx, m_schedule = make_optimizer(cfg.optim, steps, lr=lr)
    return make_train_step(model, m_tx, m_schedule, cfg)(state, batch, diag)

  def pop_step(state, lrs, active, batch, diag):
    new, metrics = jax.vmap(lambda s, lr, b: member_step(s, lr, b, diag),
                            in_axes=(0, 0, b_axis))(state, lrs, batch)
    freeze = lambda n, o: jnp.where(active.reshape((-1,) + (1,) * (n.ndim - 1)), n, o)
    return jax.tree.map(freeze, new, state), metrics

  evaluate = jax.vmap(make_eval_step(model, cfg), in_axes=(0, b_axis))
  prog = Programs(
      model=model, example=example, tx=tx, shard=shard, pop_shard=pop_shard, mesh=mesh,
      stacked_batch=stacked_batch,
      step=jax.jit(pop_step, static_argnums=4, donate_argnums=0, out_shardings=(pop_shard, rep)),
      eval=jax.jit(evaluate, out_shardings=rep),
      take=jax.jit(lambda s, i: jax.tree.map(lambda a: a[i], s), out_shardings=shard),
      stack=jax.jit(lambda ss: jax.tree.map(lambda *a: jnp.stack(a), *ss), out_shardings=pop_shard),
  )
  if len(_CACHE) >= 8:
    _CACHE.pop(next(iter(_CACHE)))
  _CACHE[key] = prog
  return prog


def put_batches(batches: list[dict], mesh, stacked: bool) -> dict:
  """Host batches (this process's rows) on the mesh: one shared batch, or stacked [P, B, ...]."""
  if not stacked:
    return sh.put_batch(batches[0], mesh)
  out = {}
  n_proc = jax.process_count()
  for k in batches[0]:
    x = np.stack([np.asarray(b[k]) for b in batches])
    if n_proc == 1:
      out[k] = jax.device_put(x, _batch_spec(True, x.shape, mesh))
    else:
      shape = (x.shape[0], x.shape[1] * n_proc) + x.shape[2:]
      out[k] = jax.make_array_from_process_local_data(
          NamedSharding(mesh, P(None, sh.BATCH)), x, shape)
  return out


# ------------------------------------------------------------------------------------------
# Checkpoint steps on disk (finalised orbax step directories are named by the step).

def _ckpt_steps(run_dir: Path) -> set[int]:
  d = run_dir / "checkpoints"
  if not d.is_dir():
    return set()
  return {int(p.name) for p in d.iterdir() if p.is_dir() and p.name.isdigit()}


def common_checkpoint(run_dirs: Sequence[Path]) -> int | None:
  """The newest checkpoint step every member has, or None."""
  steps = set.intersection(*(_ckpt_steps(Path(d)) for d in run_dirs)) if run_dirs else set()
  return max(steps) if steps else None


def _item(a):
  a = np.asarray(a)
  return a.item() if a.ndim == 0 else a.tolist()


def _sync(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


# ------------------------------------------------------------------------------------------
# Training.

def train_population(setups: Sequence[Setup], run_dirs: Sequence[str | Path], resume: bool = True,
                     progress: bool = True) -> list:
  """Train the members (prepared setups) as one program, each logged into its run directory.

  Returns one entry per member: its summary dict (status ``done``), or the RunHalted it was
  halted with. Raises Preempted on SIGTERM (every member checkpointed) and re-raises any
  other exception (members' summaries then say ``failed``).
  """
  cfgs = [s.cfg for s in setups]
  check_members(cfgs)
  cfg, mesh = cfgs[0], setups[0].mesh
  run_dirs = [Path(d) for d in run_dirs]
  n = len(setups)
  main = jax.process_index() == 0
  t_start = time.perf_counter()
  steps = cfg.train.steps
  stacked = len({c.train.seed for c in cfgs}) > 1
  sources = [s.source for s in setups] if stacked else [setups[0].source]
  prog = programs(cfg, mesh, n, stacked)
  rep = sh.replicated(mesh)
  lrs = jax.device_put(np.asarray([c.optim.lr for c in cfgs], np.float32), rep)

  start = common_checkpoint(run_dirs) if resume else None
  if main:
    for d, c in zip(run_dirs, cfgs):
      if start is None and d.exists():
        shutil.rmtree(d)   # a fresh start: nothing of an earlier attempt may remain
      d.mkdir(parents=True, exist_ok=True)
      save_config(dataclasses.replace(c, dist=DistConfig()), d / "config.yaml")  # as train() does
  _sync("population-dirs")
  ckpts = [Checkpoints(d / "checkpoints", keep=cfg.train.keep_ckpts) for d in run_dirs]
  monitors = [spikes.SpikeMonitor(window=cfg.train.spike_window,
                                  threshold=cfg.train.spike_threshold) for _ in range(n)]
  rules = [spikes.DivergenceRule() for _ in range(n)]
  if start is not None:
    target = abstract_state(prog.shard, prog.model, prog.example, prog.tx)
    members = []
    for i, ck in enumerate(ckpts):
      s, host = ck.restore(target, step=start)
      monitors[i].load_state_dict(host["monitor"])
      rules[i].load_state_dict(host["divergence"])
      members.append(s)
    state = prog.stack(members)
    del members
  else:
    start = 0
    state = prog.init_all(cfgs)
  if main:
    for d in run_dirs:
      for name in ("metrics.jsonl", "events.jsonl"):
        if (d / name).exists():
          logs.truncate_after(d / name, start - 1)
  metrics_w = [logs.JsonlWriter(d / "metrics.jsonl") if main else None for d in run_dirs]
  events_w = [logs.JsonlWriter(d / "events.jsonl") if main else None for d in run_dirs]
  tb_w = [None] * n
  if main and cfg.train.tensorboard:
    from mhc_jax.tb import TBWriter
    tb_w = [TBWriter(d / "tb") for d in run_dirs]
  tokens = cfg.data.batch_size * cfg.data.seq_len
  active = np.ones(n, bool)
  status = ["done"] * n
  message = [""] * n
  last = {"time": time.perf_counter(), "loss": [math.nan] * n, "eval": [{} for _ in range(n)]}
  stop = {"sigterm": False}
  preemption = _preemption_check()   # multi-process: a SIGTERM step all processes agree on
  old_handler = None
  if preemption is None and threading_main():
    old_handler = signal.signal(signal.SIGTERM, lambda *_: stop.update(sigterm=True))
  every = max(1, steps // 10)

  def host_state(i, step):
    return {"step": step, "data_step": step, "monitor": monitors[i].state_dict(),
            "divergence": rules[i].state_dict()}

  def batch(step, split="train"):
    return put_batches([host_batch(s, cfg, step, split) for s in sources], mesh, stacked)

  def evaluate(params):
    acc = None
    for j in range(cfg.data.eval_batches):
      out = prog.eval(params, batch(j, "validation"))
      acc = out if acc is None else jax.tree.map(jnp.add, acc, out)
    return jax.tree.map(lambda a: a / cfg.data.eval_batches, acc)

  def handle(step, metrics, evals, was_active):
    """Log step `step` for every member that was active; returns [(member, halt message)]."""
    host = {k: np.asarray(v) for k, v in jax.device_get(metrics).items()}
    if evals:
      host.update({k: np.asarray(v) for k, v in jax.device_get(evals).items()})
    now = time.perf_counter()
    dt, last["time"] = now - last["time"], now
    halts = []
    for i in np.flatnonzero(was_active):
      rec = {k: _item(v[i]) for k, v in host.items()}
      rec["step_time_s"], rec["tokens_per_s"] = dt, tokens / dt if dt > 0 else math.nan
      finite = rec.pop("finite")
      events, score = monitors[i].update(step, rec["loss"], rec["grad_norm"])
      rec["spike_score"] = score
      diverged = rules[i].update(rec["loss"]) if finite else False
      if not finite:
        events.append({"step": step, "kind": "nonfinite", "value": rec["loss"], "threshold": 0.0})
      if diverged and cfg.train.halt_on_divergence:
        events.append({"step": step, "kind": "divergence", "value": rec["loss"],
                       "threshold": float(rules[i].threshold or float("nan"))})
      if main:
        if step % cfg.train.log_every == 0 or step == steps - 1 or "gain_fwd" in rec or evals:
          metrics_w[i].write({"step": step, **rec})
          if tb_w[i] is not None:
            tb_w[i].write({"step": step, **rec})
        for e in events:
          events_w[i].write(e)
      last["loss"][i] = rec["loss"]
      if evals:
        last["eval"][i] = {k: v for k, v in rec.items() if k.startswith("eval/") and np.isscalar(v)}
      if not finite and cfg.train.nonfinite == "halt":
        halts.append((i, f"non-finite loss or gradient at step {step} (policy "
                         f"train.nonfinite=halt); the update was not applied"))
      elif diverged and cfg.train.halt_on_divergence:
        halts.append((i, f"loss diverged at step {step} ({rules[i].reason}); "
                         f"train.halt_on_divergence=true"))
    if progress and main and ((step + 1) % every == 0 or step + 1 == steps):
      losses = " ".join(f"{x:.4g}" for x in last["loss"])
      print(f"step {step + 1}/{steps} population of {n}: loss {losses} "
            f"elapsed {now - t_start:.0f}s", flush=True)
    return halts

  def apply_halts(halts):
    for i, msg in halts:
      active[i] = False
      status[i], message[i] = "halted", msg
      if main:
        metrics_w[i].close()
        events_w[i].close()
        if tb_w[i] is not None:
          tb_w[i].close()
          tb_w[i] = None

  def save_all(force=False):
    for i, ck in enumerate(ckpts):
      member = prog.take(state, i)
      done = int(member.step)
      if ck.latest() != done:
        ck.save(done, member, host_state(i, done), force=force)

  pending = None
  step = start
  sync = cfg.train.nonfinite == "halt"
  preempted = False
  try:
    for step in range(start, steps):
      if not active.any():
        break
      was_active = active.copy()
      state, metrics = prog.step(state, lrs, jax.device_put(active, rep), batch(step),
                                 _is_diag(cfg, step))
      evals = evaluate(state.params) if _due(cfg.train.eval_every, step, steps - 1) else None
      if pending is not None:
        apply_halts(handle(*pending))
      pending = (step, metrics, evals, was_active)
      if sync:
        apply_halts(handle(*pending))
        pending = None
      if preemption is not None and preemption(step):
        stop["sigterm"] = True
      if _due(cfg.train.ckpt_every, step, -1) or stop["sigterm"]:
        if pending is not None:
          apply_halts(handle(*pending))
          pending = None
        save_all(force=stop["sigterm"])
        if stop["sigterm"]:
          preempted = True
          break
    if pending is not None:
      apply_halts(handle(*pending))
    if not preempted:
      save_all(force=True)
  except BaseException:
    status = ["failed" if s == "done" else s for s in status]
    raise
  finally:
    for ck in ckpts:
      ck.close()
    if old_handler is not None:
      signal.signal(signal.SIGTERM, old_handler)
    if main:
      for i, d in enumerate(run_dirs):
        metrics_w[i].close()
        events_w[i].close()
        if tb_w[i] is not None:
          tb_w[i].close()
        member = None
        if status[i] != "failed":
          try:
            member = jax.device_get(prog.take(state, i))
          except Exception:  # noqa: BLE001 - the state may be gone with a failed step
            status[i] = "failed"
        failed = member is None
        st = "preempted" if preempted and status[i] == "done" else status[i]
        summary = {
            "status": st, "message": message[i] or (f"SIGTERM at step {step}: checkpoint saved"
                                                     if st == "preempted" else ""),
            "steps": step if failed else int(member.step), "final_loss": last["loss"][i],
            "wall_s": time.perf_counter() - t_start,
            "params": None if failed else count_params(member.params),
            "nonfinite": None if failed else int(member.nonfinite),
            "spikes": monitors[i].total_spikes, **last["eval"][i],
            "population": {"size": n, "index": i, "members": [str(x) for x in run_dirs]},
        }
        (d / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
  if preempted:
    raise Preempted(f"SIGTERM at step {step}: checkpoints saved for all {n} members")
  results: list = []
  for i in range(n):
    if status[i] == "halted":
      results.append(RunHalted(message[i]))
    else:
      results.append(json.loads((run_dirs[i] / "summary.json").read_text()) if main else {})
  return results
