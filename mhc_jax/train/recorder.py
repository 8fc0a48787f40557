"""One run's host side: its logs, spike and divergence rules, and its summary.

A :class:`Recorder` makes a run directory out of a stream of per-step metrics, for a single run
and for each member of a population; the rules: docs/interfaces.md, "Training engine".
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from mhc_jax import logs, rundir, spikes, storage
from mhc_jax.train.step import NONFINITE_TENSORS

__all__ = ["Recorder"]


class Recorder:
  def __init__(self, run_dir, cfg, *, main: bool, extra: dict | None = None):
    self.dir = storage.path(run_dir)
    self.cfg = cfg
    self.main = main
    self.extra = extra or {}
    t = cfg.train
    self.monitor = spikes.SpikeMonitor(window=t.spike_window, threshold=t.spike_threshold)
    self.divergence = spikes.DivergenceRule()
    self.diverged: dict | None = None  # {"step", "reason"} once the rule fired
    self.first_nonfinite: dict | None = None  # {"step", "layer", "tensor"}
    self.halt_message = ""
    self.last_loss = math.nan
    self.last_eval: dict = {}
    self.h_res0 = None  # token-averaged H_res [2L, n, n] at the first diagnostics step
    self.wall_before = 0.0
    self.t0 = time.perf_counter()
    self.metrics = self.events = self.tb = None

  # ---------------------------------------------------------------------------- start

  def begin(self, start: int, host: dict | None) -> None:
    """Continue from checkpoint ``start`` (``host``: its host state; None for a fresh run):
    restore the rules, drop what a killed run logged past the checkpoint (so every step is
    logged exactly once), open the logs."""
    if host:
      self.monitor.load_state_dict(host["monitor"])
      self.divergence.load_state_dict(host["divergence"])
      self.diverged = host.get("diverged")
      self.first_nonfinite = host.get("first_nonfinite")
      self.wall_before = float(host.get("wall_s", 0.0))
      if host.get("h_res0") is not None:
        self.h_res0 = np.asarray(host["h_res0"], np.float32)
    if not self.main:
      return
    from mhc_jax.train.config import DistConfig, save_config

    # without `dist`: coordinator and process id are the launch's (MHC_* variables, flags),
    # and a saved process id would make every process of a resumed run process 0
    save_config(dataclasses.replace(self.cfg, dist=DistConfig()), self.dir / "config.yaml")
    rundir.record_mixer(self.dir, self.cfg.model.mixer)
    for name in ("metrics.jsonl", "events.jsonl"):
      logs.truncate_after(self.dir / name, start - 1)
    path = self.dir / "metrics.jsonl"
    for r in logs.read_jsonl(path) if path.exists() else ():  # a resume with nothing left to do
      self._remember(r)
    self.metrics = logs.JsonlWriter(self.dir / "metrics.jsonl")
    self.events = logs.JsonlWriter(self.dir / "events.jsonl")
    if self.cfg.train.tensorboard:
      from mhc_jax.tb import TBWriter

      self.tb = TBWriter(self.dir / "tb")

  def host_state(self, step: int) -> dict:
    """What a checkpoint at ``step`` keeps of this recorder (JSON)."""
    out = {"step": step, "monitor": self.monitor.state_dict()}
    out |= {"divergence": self.divergence.state_dict(), "diverged": self.diverged}
    out |= {"first_nonfinite": self.first_nonfinite, "wall_s": self.wall_s()}
    return out | {"h_res0": None if self.h_res0 is None else self.h_res0.tolist()}

  def wall_s(self) -> float:
    return self.wall_before + time.perf_counter() - self.t0

  # ---------------------------------------------------------------------------- steps

  def _remember(self, rec: dict) -> None:
    if "loss" in rec:
      self.last_loss = rec["loss"]
    ev = {k: v for k, v in rec.items() if k.startswith("eval/") and np.isscalar(v)}
    if ev:
      self.last_eval = ev

  def record(self, step: int, rec: dict, *, has_eval: bool, dt: float, tokens: int) -> str | None:
    """Log step ``step`` (``rec``: its metrics as plain Python values, ``finite`` included).
    Returns the halt message when a policy stops the run at this step, else None."""
    cfg = self.cfg.train
    finite = bool(rec.pop("finite"))
    layer, code = rec.pop("nonfinite_at", (-1, -1))
    rec["step_time_s"], rec["tokens_per_s"] = dt, tokens / dt if dt > 0 else math.nan
    if finite:
      events, score = self.monitor.update(step, rec["loss"], rec["grad_norm"])
    else:
      events, score = self.monitor.skip(step)
      # None (-1): not located (diagnostics off), or not per layer
      where = {"layer": None if layer < 0 else layer, "tensor": (*NONFINITE_TENSORS, None)[code]}
      self.first_nonfinite = self.first_nonfinite or {"step": step, **where}
      events.append(
        {"step": step, "kind": "nonfinite", "value": rec["loss"], "threshold": 0.0, **where}
      )
    rec["spike_score"] = score
    self._h_res_shift(rec)
    fired = self.divergence.update(rec["loss"] if finite else math.nan)
    if fired and self.diverged is None:
      self.diverged = {"step": step, "reason": self.divergence.reason}
      thr, reason = float(self.divergence.threshold), self.divergence.reason
      ev = {"step": step, "kind": "divergence", "value": rec["loss"], "threshold": thr}
      events.append({**ev, "reason": reason})
    halt = None
    if not finite and cfg.nonfinite == "halt":
      halt = (
        f"non-finite loss or gradient at step {step} (policy train.nonfinite=halt); "
        f"the update was not applied"
      )
    elif fired and cfg.halt_on_divergence:
      d = self.diverged
      halt = f"loss diverged at step {d['step']} ({d['reason']}); train.halt_on_divergence=true"
    if self.main:
      due = step % cfg.log_every == 0 or step == cfg.steps - 1 or "gain_fwd" in rec
      if due or has_eval or not finite or halt:
        self.metrics.write({"step": step, **rec})
        if self.tb is not None:
          self.tb.write({"step": step, **rec})
      for e in events:
        self.events.write(e)
    self._remember(rec)
    return halt

  def _h_res_shift(self, rec: dict) -> None:
    """``h_res_shift`` per layer: RMS over the n x n entries of the token-averaged ``H_res``
    minus its value at the first diagnostics step (step 0), which a checkpoint keeps, so a
    resumed run reads as an uninterrupted one (docs/interfaces.md)."""
    h = rec.pop("h_res_avg", None)
    if h is None:
      return
    h = np.asarray(h, np.float32)
    if self.h_res0 is None:
      self.h_res0 = h
    rec["h_res_shift"] = np.sqrt(np.mean(np.square(h - self.h_res0), axis=(-2, -1))).tolist()

  def flush(self) -> None:
    """Store what was logged (before a checkpoint of the steps it covers is saved)."""
    for w in (self.metrics, self.events):
      if w is not None:
        w.flush()

  # ---------------------------------------------------------------------------- end

  def finish(
    self, status: str, message: str, steps: int | None, params: dict | None, nonfinite: int | None
  ) -> dict:
    """Close the logs and write summary.json (process 0); returns the summary."""
    if status == "done" and self.diverged is not None:
      status = "diverged"
      message = message or (
        f"the loss diverged at step {self.diverged['step']} "
        f"({self.diverged['reason']}); train.halt_on_divergence is off"
      )
    s = {"status": status, "message": message, "steps": steps, "final_loss": self.last_loss}
    s |= {"wall_s": self.wall_s(), "params": params, "nonfinite": nonfinite}
    s |= {"spikes": self.monitor.total_spikes, "divergence": self.diverged}
    s |= {"first_nonfinite": self.first_nonfinite, **self.last_eval, **self.extra}
    for w in (self.metrics, self.events, self.tb):
      if w is not None:
        w.close()
    if self.main:
      rundir.write_summary(self.dir, s)
    return s
