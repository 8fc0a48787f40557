"""The training engine: one loop for a single run and for a population of runs.

``prepare`` checks a config before anything is written; ``train`` trains one run; ``run_members``
trains a program's members (docs/interfaces.md, "Training engine").
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from mhc_jax import data, rundir, storage
from mhc_jax.errors import ConfigError, Preempted, RunHalted
from mhc_jax.model import Transformer, count_params
from mhc_jax.train import dist, sharding as sh
from mhc_jax.train.checkpoint import Checkpoints
from mhc_jax.train.config import Config, with_data_vocab
from mhc_jax.train.optim import make_optimizer
from mhc_jax.train.recorder import Recorder
from mhc_jax.train.state import abstract_boxed, abstract_state, create_state, state_shardings
from mhc_jax.train.step import make_eval_step, make_train_step


@dataclasses.dataclass
class Setup:
  cfg: Config
  source: object
  mesh: jax.sharding.Mesh


def check_data(cfg: Config) -> tuple[Config, object]:
  """``(cfg with the source's vocabulary, source)``: the data checks, touching no device
  (ConfigError naming ``data.options`` / ``data.target``)."""
  try:
    source = data.make_source(
      cfg.data.task, seq_len=cfg.data.seq_len, seed=cfg.train.seed, **cfg.data.options
    )
  except (ValueError, FileNotFoundError) as e:
    raise ConfigError(f"data.options: {e}") from None
  cfg = with_data_vocab(cfg, source.vocab_size)
  if cfg.data.target == "posterior" and not source.has_posterior:
    raise ConfigError("data.target: 'posterior' needs a task with an exact posterior")
  return cfg, source


_SHAPES_CHECKED: set = set()


def prepare(cfg: Config, devices=None) -> Setup:
  """Everything that can fail on bad input, before any file is written (ConfigError).

  ``devices``: the devices the mesh spans (default all, ``jax.devices()``), e.g.
  ``jax.devices()[:1]`` for a one-device run in a process that has more.
  """
  cfg, source = check_data(cfg)
  if cfg.train.eval_every:
    try:
      source.batch(0, cfg.data.batch_size, "validation")
    except ValueError as e:
      raise ConfigError(
        f"data.options: {e} (train.eval_every={cfg.train.eval_every} evaluates "
        f"on the validation split)"
      ) from None
  # shapes only: what the option types cannot say (e.g. mhc_lite's n! permutations); once per
  # model and optimiser in a process (a sweep's lr x seed grid shares them)
  key = repr((cfg.model, dataclasses.replace(cfg.optim, lr=1.0), cfg.data.seq_len))
  if key not in _SHAPES_CHECKED:
    try:
      tx, _ = make_optimizer(cfg.optim, cfg.train.steps, model=cfg.model)
      abstract_boxed(Transformer(cfg.model), jnp.zeros((1, cfg.data.seq_len), jnp.int32), tx)
    except ConfigError:  # a parameter without a role (mhc_jax.parametrization.labels)
      raise
    except ValueError as e:
      raise ConfigError(f"model.mixer_options: {e}") from None
    _SHAPES_CHECKED.add(key)
  mesh = sh.make_mesh(cfg.mesh, cfg.data.batch_size, devices)
  return Setup(cfg, source, mesh)


def host_batch(source, cfg: Config, step: int, split: str = "train") -> dict:
  """This process's rows of global batch ``step`` as numpy."""
  b = {k: np.asarray(v) for k, v in source.batch(step, cfg.data.batch_size, split).items()}
  keep = ("inputs", "targets", "mask", "posterior", "evidence")
  return sh.local_rows({k: v for k, v in b.items() if k in keep})


def is_diag_step(cfg: Config, step: int) -> bool:
  d = cfg.train.diag_every
  return bool(d) and (step % d == 0 or step == cfg.train.steps - 1)


def is_due(every: int, step: int, last: int) -> bool:
  return bool(every) and ((step + 1) % every == 0 or step == last)


def mean_over_batches(eval_fn, params, batch_fn, n: int):
  """Mean of ``eval_fn(params, batch_fn(i))`` over validation batches ``i < n`` (on device)."""
  acc = None
  for i in range(n):
    out = eval_fn(params, batch_fn(i))
    acc = out if acc is None else jax.tree.map(jnp.add, acc, out)
  return jax.tree.map(lambda a: a / n, acc)


# -------------------------------------------- The programs: a single run is a program of one member
class Program:
  """The engine's program interface (``n``, ``init``, ``abstract``, ``stack``, ``member``,
  ``step``, ``evaluate``, ``to_host``, ``params``): the parts a run and a population share."""

  def abstract(self):
    return abstract_state(self.shard, self.model, self.example, self.tx)

  def evaluate(self, state):
    return mean_over_batches(
      self._eval, state.params, lambda i: self.batch(i, "validation"), self.cfg.data.eval_batches
    )

  def params(self) -> dict:
    return count_params(self.abstract().params)


class SingleProgram(Program):
  """How a single run's state is made, stepped, evaluated."""

  n = 1

  def __init__(self, setup: Setup):
    cfg, mesh = setup.cfg, setup.mesh
    self.cfg, self.source, self.mesh = cfg, setup.source, mesh
    self.model = Transformer(cfg.model)
    self.tx, schedule = make_optimizer(cfg.optim, cfg.train.steps, model=cfg.model)
    self.example = jnp.zeros((1, cfg.data.seq_len), jnp.int32)
    self.shard = state_shardings(self.model, self.example, self.tx, mesh)
    self._step = jax.jit(
      make_train_step(self.model, self.tx, schedule, cfg),
      static_argnums=2,
      donate_argnums=0,
      out_shardings=(self.shard, sh.replicated(mesh)),
    )
    self._eval = jax.jit(make_eval_step(self.model, cfg), out_shardings=sh.replicated(mesh))

  def init(self):
    return create_state(self.model, self.example, self.tx, self.mesh, self.cfg.train.seed)[0]

  def stack(self, members):
    return members[0]

  def member(self, state, i: int):
    return state

  def batch(self, step: int, split: str = "train"):
    return sh.put_batch(host_batch(self.source, self.cfg, step, split), self.mesh)

  def step(self, state, active, step: int, diag: bool):
    return self._step(state, self.batch(step), diag)

  def to_host(self, tree) -> dict:
    return {k: np.asarray(v)[None] for k, v in jax.device_get(tree).items()}

  def trace(self) -> None:
    """Trace the step (and the evaluation) on abstract values: shape errors without compiling."""

    shapes = lambda b: jax.tree.map(lambda v: jax.ShapeDtypeStruct(np.shape(v), v.dtype), b)
    state = self.abstract()
    self._step.trace(state, shapes(host_batch(self.source, self.cfg, 0)), is_diag_step(self.cfg, 0))
    if self.cfg.train.eval_every:
      self._eval.trace(state.params, shapes(host_batch(self.source, self.cfg, 0, "validation")))


# --------------------------------------------------------------------------------------- The engine
class _Progress:
  """tqdm on a terminal; plain periodic lines otherwise (logs, CI)."""

  def __init__(self, total: int, start: int, enabled: bool, n: int):
    self.enabled, self.total, self.n = enabled, total, n
    self.tty = enabled and n == 1 and sys.stderr.isatty()
    self.bar = tqdm(total=total, initial=start, dynamic_ncols=True) if self.tty else None
    self.every = max(1, total // 10)
    self.t0 = time.perf_counter()

  def update(self, step: int, recs: list) -> None:
    if not self.enabled or not recs:
      return
    if self.n == 1:
      rec, nan = recs[0], float("nan")
      text = f"loss {rec['loss']:.4f} gnorm {rec['grad_norm']:.3g} "
      text += f"tok/s {rec.get('tokens_per_s', nan):.0f}"
    else:
      text = f"population of {self.n}: loss " + " ".join(f"{r['loss']:.4g}" for r in recs)
    if self.bar is not None:
      self.bar.set_postfix_str(text, refresh=False)
      self.bar.update(1)
    elif (step + 1) % self.every == 0 or step + 1 == self.total:
      elapsed = time.perf_counter() - self.t0
      print(f"step {step + 1}/{self.total} {text} elapsed {elapsed:.0f}s", flush=True)

  def close(self):
    if self.bar is not None:
      self.bar.close()


def _item(a):
  a = np.asarray(a)
  return a.item() if a.ndim == 0 else a.tolist()


def _finished(run_dirs) -> list | None:
  """The summaries when every run is finished (done, halted or diverged, at its last
  checkpoint): a resume then changes nothing. Else None."""
  out = []
  for d in run_dirs:
    s = rundir.read_summary(d)
    steps = rundir.checkpoint_steps(d)
    if s.get("status") not in rundir.FINISHED or not steps or max(steps) != s.get("steps"):
      return None
    out.append(s)
  return out


def _results(summaries: list) -> list:
  return [RunHalted(s["message"]) if s.get("status") == "halted" else s for s in summaries]


def run_members(
  program, cfgs, run_dirs, *, resume: bool, progress: bool, extra: list | None = None
) -> list:
  """Train ``program``'s members into ``run_dirs`` (one each; ``cfgs`` their configs).

  Returns one entry per member: its summary dict, or the RunHalted it was halted with.
  Raises Preempted on SIGTERM (every member checkpointed) and re-raises any other exception
  (the members' summaries then say ``failed``). ``extra``: fields added to each summary.
  """
  n = program.n
  main = dist.is_main()
  run_dirs = [storage.path(d) for d in run_dirs]
  with contextlib.ExitStack() as locks:
    if main:
      for d in run_dirs:
        locks.enter_context(rundir.Lock(d))
      if not resume:
        for d in run_dirs:
          if rundir.holds_run(d):
            raise FileExistsError(
              f"{d} already holds a run; resume=True continues it (runs are never overwritten)"
            )
    if resume:
      done = _finished(run_dirs)
      if done is not None:
        return _results(done)
    return _run(program, cfgs, run_dirs, resume, progress and main, main, extra or [None] * n)


def _run(program, cfgs, run_dirs, resume, progress, main, extra) -> list:
  cfg, n = cfgs[0], program.n
  steps = cfg.train.steps
  recorders = [Recorder(d, c, main=main, extra=e) for d, c, e in zip(run_dirs, cfgs, extra)]
  ckpts = [Checkpoints(d / "checkpoints", keep=cfg.train.keep_ckpts) for d in run_dirs]
  common = set.intersection(*(rundir.checkpoint_steps(d) for d in run_dirs)) if resume else set()
  start = max(common) if common else None
  for ck in ckpts:  # checkpoints past the start belong to an abandoned attempt
    ck.prune_after(-1 if start is None else start)
  if start is not None:
    target = program.abstract()
    restored = [ck.restore(target, step=start) for ck in ckpts]
    hosts = [host for _, host in restored]
    state = program.stack([s for s, _ in restored])
    del restored
  else:
    start, hosts = 0, [None] * n
    state = program.init()
  for r, h in zip(recorders, hosts):
    r.begin(start, h)
  dist.sync("run directories ready")

  tokens = cfg.data.batch_size * cfg.data.seq_len
  active = np.ones(n, bool)
  halted = [""] * n
  bar = _Progress(steps, start, progress, n)
  stop = {"sigterm": False}
  preemption = dist.preemption_check()  # multi-process: a SIGTERM step all processes agree on
  old_handler = None
  if preemption is None and dist.in_main_thread():
    old_handler = signal.signal(signal.SIGTERM, lambda *_: stop.update(sigterm=True))
  last_time = [time.perf_counter()]

  def handle(pending) -> bool:
    """Record one dispatched step for the members it ran on; True when one halted."""
    step, metrics, evals, was_active = pending
    host = program.to_host(metrics)
    if evals is not None:
      host.update(program.to_host(evals))
    now = time.perf_counter()
    dt, last_time[0] = now - last_time[0], now
    any_halt, recs = False, []
    for i in np.flatnonzero(was_active):
      rec = {k: _item(v[i]) for k, v in host.items()}
      msg = recorders[i].record(step, rec, has_eval=evals is not None, dt=dt, tokens=tokens)
      recs.append(rec)
      if msg and active[i]:
        active[i], halted[i], any_halt = False, msg, True
    bar.update(step, recs)
    return any_halt

  def save_all(force: bool) -> None:
    for r in recorders:  # the logs of the steps a checkpoint holds are stored before it
      r.flush()
    for i, ck in enumerate(ckpts):
      member = program.member(state, i)
      done = int(member.step)
      if ck.latest() != done:
        ck.save(done, member, recorders[i].host_state(done), force=force)

  pending = None
  step = start
  sync_each = cfg.train.nonfinite == "halt"  # halt must stop before another update is applied
  preempted = failed = False
  try:
    for step in range(start, steps):
      if not active.any():
        break
      was_active = active.copy()
      state, metrics = program.step(state, active, step, is_diag_step(cfg, step))
      evals = program.evaluate(state) if is_due(cfg.train.eval_every, step, steps - 1) else None
      prev, pending = pending, (step, metrics, evals, was_active)
      if (prev is not None and handle(prev)) or sync_each:
        # a member halted at the previous step has had this one applied: it is logged too
        handle(pending)
        pending = None
      if preemption is not None and preemption(step):
        stop["sigterm"] = True
      if is_due(cfg.train.ckpt_every, step, -1) or stop["sigterm"]:
        if pending is not None:
          handle(pending)
          pending = None
        save_all(force=stop["sigterm"])
        if stop["sigterm"]:
          preempted = True
          break
    if pending is not None:
      handle(pending)
      pending = None
    if not preempted:
      save_all(force=True)
  except BaseException:
    failed = True
    raise
  finally:
    for ck in ckpts:
      ck.close()
    bar.close()
    if old_handler is not None:
      signal.signal(signal.SIGTERM, old_handler)
    summaries = _finish(program, state, recorders, halted, preempted, failed, step)
  if preempted:
    who = "" if n == 1 else f" for all {n} members"
    raise Preempted(f"SIGTERM at step {step}: checkpoint{'s' if n > 1 else ''} saved{who}")
  return _results(summaries)


def _finish(program, state, recorders, halted, preempted, failed, step) -> list:
  out = []
  for i, r in enumerate(recorders):
    info = None
    if not failed:
      with contextlib.suppress(Exception):  # the state may be gone with a failed step
        m = program.member(state, i)
        info = (int(m.step), program.params(), int(m.nonfinite))
    if info is None:
      status, info = "failed", (step, None, None)
    else:
      status = "halted" if halted[i] else "preempted" if preempted else "done"
    stopped = f"SIGTERM at step {step}: checkpoint saved" if status == "preempted" else ""
    out.append(r.finish(status, halted[i] or stopped, *info))
  return out


def train(setup: Setup, run_dir, resume: bool = False, progress: bool = True) -> dict:
  """Train one run into ``run_dir``; returns the summary (also written to summary.json).

  Raises RunHalted when a policy stopped it, Preempted on SIGTERM; FileExistsError when
  ``run_dir`` holds a run and ``resume`` is False (runs are never overwritten); RunLocked
  when another trainer holds ``run_dir``.
  """
  (result,) = run_members(
    SingleProgram(setup), [setup.cfg], [run_dir], resume=resume, progress=progress
  )
  if isinstance(result, RunHalted):
    raise result
  return result if dist.is_main() else {}
