"""The training loop: one jitted, sharded step per batch; host-side logging one step behind.

``prepare(cfg)`` validates everything that can be validated before a file is written (data
source options, vocabulary, mesh vs devices). ``train(cfg, run_dir, resume)`` then runs:
state created in its shards, optional restore from the latest orbax checkpoint (data position
included: batch ``i`` is a pure function of ``(seed, i)``), and per step: dispatch step ``i``,
then fetch and log step ``i-1`` (so the host never stalls the device), spike detection,
divergence and non-finite policies, evaluation, checkpoints, SIGTERM handling. Only process 0
writes files.
"""
from __future__ import annotations

import dataclasses
import json
import signal
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from mhc_jax import data, logs, spikes
from mhc_jax.model import Transformer, count_params
from mhc_jax.tb import TBWriter
from mhc_jax.train import sharding as sh
from mhc_jax.train.checkpoint import Checkpoints
from mhc_jax.train.config import Config, ConfigError, DistConfig, save_config, with_data_vocab
from mhc_jax.train.optim import make_optimizer
from mhc_jax.train.state import abstract_state, create_state
from mhc_jax.train.step import make_eval_step, make_train_step


class RunHalted(RuntimeError):
  """The run stopped by policy (non-finite values or divergence) after saving a checkpoint."""


class Preempted(RuntimeError):
  """SIGTERM: a checkpoint was saved and the run can be resumed."""


@dataclasses.dataclass
class Setup:
  cfg: Config
  source: object
  mesh: jax.sharding.Mesh


def prepare(cfg: Config, devices=None) -> Setup:
  """Everything that can fail on bad input, before any file is written (ConfigError).

  ``devices``: the devices the mesh spans (default all, ``jax.devices()``), e.g.
  ``jax.devices()[:1]`` for a one-device run in a process that has more.
  """
  try:
    source = data.make_source(cfg.data.task, seq_len=cfg.data.seq_len, seed=cfg.train.seed,
                              **cfg.data.options)
  except (ValueError, FileNotFoundError) as e:
    raise ConfigError(f"data.options: {e}") from None
  cfg = with_data_vocab(cfg, source.vocab_size)
  if cfg.model.vocab < source.vocab_size:
    raise ConfigError(f"model.vocab: {cfg.model.vocab} is smaller than the data's vocabulary "
                      f"({source.vocab_size})")
  if cfg.data.target == "posterior" and not source.has_posterior:
    raise ConfigError("data.target: 'posterior' needs a task with an exact posterior")
  mesh = sh.make_mesh(cfg.mesh, cfg.data.batch_size, devices)
  return Setup(cfg, source, mesh)


def host_batch(source, cfg: Config, step: int, split: str = "train") -> dict:
  """This process's rows of global batch ``step`` as numpy (plus the fault-injection plant)."""
  b = {k: np.asarray(v) for k, v in source.batch(step, cfg.data.batch_size, split).items()}
  keep = ("inputs", "targets", "mask", "posterior", "evidence")
  b = sh.local_rows({k: v for k, v in b.items() if k in keep})
  if cfg.train.inject_nonfinite_at >= 0 and split == "train":
    v = np.nan if step == cfg.train.inject_nonfinite_at else 1.0
    b["plant"] = np.full((len(b["inputs"]),), v, np.float32)
  return b


def _is_diag(cfg: Config, step: int) -> bool:
  d = cfg.train.diag_every
  return bool(d) and (step % d == 0 or step == cfg.train.steps - 1)


def _due(every: int, step: int, last: int) -> bool:
  return bool(every) and ((step + 1) % every == 0 or step == last)


class _Progress:
  """tqdm on a terminal; plain periodic lines otherwise (logs, CI)."""

  def __init__(self, total: int, start: int, enabled: bool):
    self.enabled, self.total = enabled, total
    self.tty = enabled and sys.stderr.isatty()
    self.bar = tqdm(total=total, initial=start, dynamic_ncols=True) if self.tty else None
    self.every = max(1, total // 10)
    self.t0 = time.perf_counter()

  def update(self, step: int, rec: dict) -> None:
    if not self.enabled:
      return
    text = (f"loss {rec['loss']:.4f} gnorm {rec['grad_norm']:.3g} "
            f"tok/s {rec.get('tokens_per_s', float('nan')):.0f}")
    if self.bar is not None:
      self.bar.set_postfix_str(text, refresh=False)
      self.bar.update(1)
    elif (step + 1) % self.every == 0 or step + 1 == self.total:
      done = step + 1
      el = time.perf_counter() - self.t0
      print(f"step {done}/{self.total} {text} elapsed {el:.0f}s", flush=True)

  def close(self):
    if self.bar is not None:
      self.bar.close()


def _to_host(tree) -> dict:
  out = {}
  for k, v in jax.device_get(tree).items():
    a = np.asarray(v)
    out[k] = a.item() if a.ndim == 0 else a.tolist()
  return out


_RUN_FILES = ("config.yaml", "metrics.jsonl", "events.jsonl", "summary.json", "checkpoints")


def train(setup: Setup, run_dir: str | Path, resume: bool = False, progress: bool = True) -> dict:
  """Train one run into ``run_dir``; returns the summary (also written to summary.json)."""
  cfg, source, mesh = setup.cfg, setup.source, setup.mesh
  run_dir = Path(run_dir)
  main = jax.process_index() == 0
  if main and not resume and any((run_dir / n).exists() for n in _RUN_FILES):
    raise FileExistsError(f"{run_dir} already holds a run; resume=True continues it "
                          f"(runs are never overwritten)")
  t_start = time.perf_counter()
  model = Transformer(cfg.model)
  steps = cfg.train.steps
  tx, schedule = make_optimizer(cfg.optim, steps)
  example = jnp.zeros((1, cfg.data.seq_len), jnp.int32)
  state, shard = create_state(model, example, tx, mesh, cfg.train.seed)
  if main:
    run_dir.mkdir(parents=True, exist_ok=True)
    # without `dist`: coordinator and process id are the launch's (MHC_* variables, flags),
    # and a saved process id would make every process of a resumed run process 0
    save_config(dataclasses.replace(cfg, dist=DistConfig()), run_dir / "config.yaml")
  ckpt = Checkpoints(run_dir / "checkpoints", keep=cfg.train.keep_ckpts)
  monitor = spikes.SpikeMonitor(window=cfg.train.spike_window, threshold=cfg.train.spike_threshold)
  divergence = spikes.DivergenceRule()
  start = 0
  if resume and ckpt.latest() is not None:
    state, host = ckpt.restore(abstract_state(shard, model, example, tx))
    start = int(host["step"])
    monitor.load_state_dict(host["monitor"])
    divergence.load_state_dict(host["divergence"])
  if main:  # every step exactly once: drop what a killed run logged past its checkpoint
    for name in ("metrics.jsonl", "events.jsonl"):
      if (run_dir / name).exists():
        logs.truncate_after(run_dir / name, start - 1)

  step_fn = jax.jit(make_train_step(model, tx, schedule, cfg), static_argnums=2,
                    donate_argnums=0, out_shardings=(shard, sh.replicated(mesh)))
  eval_fn = jax.jit(make_eval_step(model, cfg), out_shardings=sh.replicated(mesh))
  metrics_w = logs.JsonlWriter(run_dir / "metrics.jsonl") if main else None
  events_w = logs.JsonlWriter(run_dir / "events.jsonl") if main else None
  tb_w = TBWriter(run_dir / "tb") if main and cfg.train.tensorboard else None
  tokens = cfg.data.batch_size * cfg.data.seq_len
  bar = _Progress(steps, start, progress and main)
  stop = {"sigterm": False}
  preempted = _preemption_check()
  old_handler = None
  if preempted is None and threading_main():
    old_handler = signal.signal(signal.SIGTERM, lambda *_: stop.update(sigterm=True))

  def host_state(step):
    return {"step": step, "data_step": step, "monitor": monitor.state_dict(),
            "divergence": divergence.state_dict()}

  last = {"time": time.perf_counter(), "loss": float("nan"), "eval": {}}
  status, message = "done", ""

  def handle(step, metrics, evals):
    """Fetch step ``step``'s metrics, log them, apply the spike/divergence/non-finite rules."""
    rec = _to_host(metrics)
    rec.update(_to_host(evals) if evals else {})
    now = time.perf_counter()
    dt, last["time"] = now - last["time"], now
    rec["step_time_s"], rec["tokens_per_s"] = dt, tokens / dt if dt > 0 else float("nan")
    finite = rec.pop("finite")
    events, score = monitor.update(step, rec["loss"], rec["grad_norm"])
    rec["spike_score"] = score
    diverged = divergence.update(rec["loss"]) if finite else False
    if not finite:
      events.append({"step": step, "kind": "nonfinite", "value": rec["loss"], "threshold": 0.0})
    if diverged and cfg.train.halt_on_divergence:
      events.append({"step": step, "kind": "divergence", "value": rec["loss"],
                     "threshold": float(divergence.threshold or float("nan"))})
    if main:
      if step % cfg.train.log_every == 0 or step == steps - 1 or "gain_fwd" in rec or evals:
        metrics_w.write({"step": step, **rec})
        if tb_w is not None:
          tb_w.write({"step": step, **rec})
      for e in events:
        events_w.write(e)
    last["loss"] = rec["loss"]
    if evals:
      last["eval"] = {k: v for k, v in rec.items() if k.startswith("eval/") and np.isscalar(v)}
    bar.update(step, rec)
    if not finite and cfg.train.nonfinite == "halt":
      return (f"non-finite loss or gradient at step {step} (policy train.nonfinite=halt); "
              f"the update was not applied")
    if diverged and cfg.train.halt_on_divergence:
      return f"loss diverged at step {step} ({divergence.reason}); train.halt_on_divergence=true"
    return None

  pending = None
  step = start
  sync = cfg.train.nonfinite == "halt"   # halt must stop before another update is applied
  try:
    for step in range(start, steps):
      batch = sh.put_batch(host_batch(source, cfg, step), mesh)
      state, metrics = step_fn(state, batch, _is_diag(cfg, step))
      evals = None
      if _due(cfg.train.eval_every, step, steps - 1):
        evals = evaluate(eval_fn, state.params, source, cfg, mesh)
      if pending is not None:
        message = handle(*pending)
      pending = (step, metrics, evals)
      if sync or message:
        message = message or handle(*pending)
        pending = None
      if message:
        status = "halted"
        break
      if preempted is not None and preempted(step):
        stop["sigterm"] = True
      if _due(cfg.train.ckpt_every, step, -1) or stop["sigterm"]:
        if pending is not None:
          message = handle(*pending)
          pending = None
          if message:
            status = "halted"
            break
        ckpt.save(step + 1, state, host_state(step + 1), force=stop["sigterm"])
        if stop["sigterm"]:
          status, message = "preempted", f"SIGTERM at step {step}: checkpoint saved"
          break
    if pending is not None:
      message = handle(*pending) or message
      status = "halted" if message and status == "done" else status
    if status != "preempted":
      done = int(state.step)
      if ckpt.latest() != done:
        ckpt.save(done, state, host_state(done), force=True)
  except BaseException:
    status = "failed"
    raise
  finally:
    ckpt.close()
    bar.close()
    if old_handler is not None:
      signal.signal(signal.SIGTERM, old_handler)
    if main:
      metrics_w.close()
      events_w.close()
      if tb_w is not None:
        tb_w.close()
      summary = {
          "status": status, "message": message, "steps": int(state.step) if status != "failed"
          else step, "final_loss": last["loss"], "wall_s": time.perf_counter() - t_start,
          "params": count_params(state.params) if status != "failed" else None,
          "nonfinite": int(state.nonfinite) if status != "failed" else None,
          "spikes": monitor.total_spikes, **last["eval"],
      }
      (run_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
  if status == "halted":
    raise RunHalted(message)
  if status == "preempted":
    raise Preempted(message)
  return summary if main else {}


def _preemption_check():
  """Several processes must save a SIGTERM checkpoint at the same step, or the first one to
  save waits in the save for the others while they wait in the next step for it. There, JAX's
  preemption service (it catches SIGTERM on every process) picks a step all of them reach:
  returns ``step -> bool``, to be called at every step. None in a single process (a plain
  SIGTERM handler does) or when the service is off."""
  if jax.process_count() == 1 or not jax.config.jax_enable_preemption_service:
    return None
  from jax.experimental import multihost_utils
  return multihost_utils.reached_preemption_sync_point


def threading_main() -> bool:
  import threading
  return threading.current_thread() is threading.main_thread()


def evaluate(eval_fn, params, source, cfg: Config, mesh) -> dict:
  """Mean of the eval metrics over ``data.eval_batches`` validation batches (device arrays)."""
  acc = None
  n = cfg.data.eval_batches
  for i in range(n):
    b = sh.put_batch(host_batch(source, cfg, i, split="validation"), mesh)
    out = eval_fn(params, b)
    acc = out if acc is None else jax.tree.map(jnp.add, acc, out)
  return jax.tree.map(lambda a: a / n, acc)
