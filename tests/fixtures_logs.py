"""Realistic synthetic run and sweep directories (docs/interfaces.md layout), for report tests.

Nothing here trains: the series are made up but shaped like the trainer's (``metrics.jsonl``
with scalars every step and per-layer lists of length 2L every ``diag_every`` steps, eval
records as separate lines at the same step, ``events.jsonl`` from the real host-side
``SpikeMonitor`` / ``DivergenceRule``, ``summary.json``, ``config.yaml``, a sweep
``manifest.json``). Deterministic for a given argument set.

* ``hc`` composite Amax gain compounds with depth and training; ``mhc`` stays near 1 with a
  small Sinkhorn column error; ``residual`` is exactly 1.
* ``gain_metrics="new"`` (default) also writes the per-token composites
  (``amax_*_composite_tok_mean`` / ``_tok_max``: for ``hc`` well above the token-averaged
  composite and growing faster with depth, for ``mhc`` the per-token backward gain above 1 where
  the averaged one is ~1), the attenuation ``amin_*_composite`` and the suffix products
  ``amax_*_suffix``; ``gain_metrics="old"`` leaves them out, as logs written before they existed.
* ``spike=(mixer, depth, lr, step)`` plants a loss/grad-norm spike at that step.
* ``diverge=(mixer, depth, lr, step)`` makes that run blow up: loss grows x1.6 per step, then
  NaN with an inf grad norm; the run halts once the real ``DivergenceRule`` has declared
  divergence and at least 8 steps after ``step`` (status failed / halted).
* ``pending`` adds a run that never started (manifest only), ``failed_empty`` a run that
  failed before logging anything (config.yaml only).
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import yaml

from mhc_jax.logs import JsonlWriter
from mhc_jax.spikes import DivergenceRule, SpikeMonitor

VOCAB = 20


def _run_name(mixer: str, depth: int, width: int, lr: float, seed: int) -> str:
  return f"{mixer}_L{depth}_C{width}_lr{lr:g}_s{seed}"


def write_run(
  run_dir: str | Path,
  *,
  mixer: str = "mhc",
  depth: int = 2,
  width: int = 32,
  lr: float = 1e-2,
  seed: int = 0,
  steps: int = 120,
  diag_every: int = 10,
  eval_every: int = 40,
  spike_at: int | None = None,
  diverge_at: int | None = None,
  n_streams: int = 4,
  wind_tunnel: bool = True,
  gain_metrics: str = "new",
  kl_scale: float = 1.0,
) -> dict[str, Any]:
  """Write one run directory; returns ``{"status", "steps"}`` (manifest status)."""
  run_dir = Path(run_dir)
  run_dir.mkdir(parents=True, exist_ok=True)
  n = 1 if mixer == "residual" else n_streams
  cfg = {
    "model": {"mixer": mixer, "depth": depth, "width": width, "n_streams": n},
    "optim": {"lr": lr},
    "train": {"seed": seed, "steps": steps, "diag_every": diag_every, "eval_every": eval_every},
    "data": {"task": "bijection" if wind_tunnel else "text"},
  }
  (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))

  rng = np.random.default_rng(zlib.crc32(f"{mixer}/{depth}/{width}/{lr:g}/{seed}".encode()))
  nl = 2 * depth
  lr_opt = 1e-2
  floor = (
    0.35
    + 0.5 * math.log10(lr / lr_opt) ** 2
    + {"residual": 0.08, "hc": 0.04, "mhc": 0.0}.get(mixer, 0.02)
  )
  floor += 0.03 * depth if mixer == "hc" else 0.0
  rate = 0.02 + 2.0 * min(lr, 0.05)
  loss0 = math.log(VOCAB) + 0.05 * rng.standard_normal()
  hc_growth = 0.06 + 0.4 * lr  # per-layer Amax excess of HC at the end of training

  monitor = SpikeMonitor()
  rule = DivergenceRule()
  nonfinite = 0
  status, last = "done", steps
  halt_at = None if diverge_at is None else diverge_at + 8
  with JsonlWriter(run_dir / "metrics.jsonl") as mw, JsonlWriter(run_dir / "events.jsonl") as ew:
    for step in range(1, steps + 1):
      prog = step / steps
      loss = floor + (loss0 - floor) * math.exp(-rate * step) + 0.02 * rng.standard_normal()
      grad = 0.4 + 1.5 * math.exp(-step / 30) + 3.0 * lr + 0.03 * abs(rng.standard_normal())
      if spike_at is not None and step == spike_at:
        loss, grad = 2.0 * loss0, grad * 20.0
      if diverge_at is not None and step >= diverge_at:
        k = step - diverge_at
        loss = loss * 1.6 ** (k + 1) if k < 5 else math.nan
        grad = grad * 3.0 ** (k + 1) if k < 5 else math.inf
      if not (math.isfinite(loss) and math.isfinite(grad)):
        nonfinite += 1
        ew.write({"step": step, "kind": "nonfinite", "value": loss, "threshold": math.nan})
      if hasattr(monitor, "skip") and not (math.isfinite(loss) and math.isfinite(grad)):
        events, score = monitor.skip(step)  # the trainer's path for a non-finite step
      else:
        events, score = monitor.update(step, loss, grad)
      ew.write_many(events)
      if rule.update(loss) and rule.reason and status == "done":
        status = "failed"
        ew.write(
          {
            "step": step,
            "kind": "divergence",
            "value": loss,
            "threshold": rule.threshold,
            "reason": rule.reason,
          }
        )
      rec: dict[str, Any] = {
        "step": step,
        "loss": loss,
        "z_loss": 1e-4 * loss,
        "lr": lr * min(1.0, step / 10),
        "grad_norm": grad,
        "grad_norm_clipped": min(grad, 1.0),
        "param_norm": 20.0 + 0.05 * step,
        "update_rms_lr": 0.9,
        "tokens_per_s": 5e4,
        "step_time_s": 0.01,
        "nonfinite": nonfinite,
        "spike_score": score,
      }
      if step % diag_every == 0 or step == 1:
        bad = diverge_at is not None and step >= diverge_at + 5
        if mixer == "residual":
          amax = np.ones(nl)
          amax_b = np.ones(nl)
        elif mixer == "hc":
          amax = 1.0 + hc_growth * prog * (1 + 0.3 * rng.random(nl))
          amax_b = 1.0 + hc_growth * prog * (1 + 0.3 * rng.random(nl))
        else:  # doubly stochastic: exact rows, Sinkhorn error in the columns
          amax = np.ones(nl)
          amax_b = 1.0 + 2e-3 * rng.random(nl)
        comp_f, comp_b = np.cumprod(amax), np.cumprod(amax_b)
        gain = 1.0 + (0.6 if mixer == "hc" else 0.3) / (np.arange(nl) + 1) * (0.5 + prog)
        gain = gain * (1 + 0.02 * rng.standard_normal(nl))
        grad_rms = 1e-3 * np.cumprod(np.full(nl, 1.05))[::-1]
        if mixer == "residual":
          tok_f = tok_b = np.ones(nl)
          tok_fmax = tok_bmax = np.ones(nl)
        elif mixer == "hc":  # token-to-token variation compounds: averaging hides it
          tok_f = comp_f * (1 + 0.04 * prog * np.arange(1, nl + 1))
          tok_b = comp_b * (1 + 0.05 * prog * np.arange(1, nl + 1))
          tok_fmax, tok_bmax = (
            tok_f * (1.3 + 0.1 * rng.random()),
            tok_b * (1.4 + 0.1 * rng.random()),
          )
        else:  # per-token rows exact; per-token columns off by the Sinkhorn truncation
          tok_f, tok_fmax = np.ones(nl), np.ones(nl)
          tok_b = 1.0 + 0.004 * np.arange(1, nl + 1) * (1 + 0.1 * rng.random())
          tok_bmax = 1.0 + 0.02 * np.arange(1, nl + 1) * (1 + 0.1 * rng.random())
        per = {
          "gain_fwd": gain,
          "branch_ratio": 0.3 / np.sqrt(np.arange(nl) + 1),
          "grad_rms": grad_rms,
          "gain_bwd": np.append(grad_rms[:-1] / grad_rms[1:], math.nan),
          "amax_fwd": amax,
          "amax_bwd": amax_b,
          "amax_fwd_composite": comp_f,
          "amax_bwd_composite": comp_b,
          "log_colsum_max": np.abs(np.log(comp_b)),
          "sinkhorn_err": np.full(nl, 1e-4 if mixer.startswith("mhc") else 0.0),
        }
        if gain_metrics == "new":
          per.update(
            {
              "amax_fwd_composite_tok_mean": tok_f,
              "amax_fwd_composite_tok_max": tok_fmax,
              "amax_bwd_composite_tok_mean": tok_b,
              "amax_bwd_composite_tok_max": tok_bmax,
              "amin_fwd_composite": 1.0 / comp_f if mixer == "hc" else np.ones(nl),
              "amin_bwd_composite": (1.0 / comp_b if mixer == "hc" else 2.0 - comp_b),
              "amax_fwd_suffix": np.cumprod(amax[::-1])[::-1],
              "amax_bwd_suffix": np.cumprod(amax_b[::-1])[::-1],
            }
          )
        if bad:
          per = {k: np.full(nl, math.nan) for k in per}
        rec.update({k: np.asarray(v, dtype=np.float32) for k, v in per.items()})
        rec["attn_logit_max"] = 5.0 + rng.random(depth)
        rec["layer_grad_norm"] = 0.1 + rng.random(depth)
        rec.update(
          out_logit_max=8.0,
          logsumexp_mean=3.0,
          logsumexp_max=4.0,
          growth_exponent=math.nan if bad else float(np.log(np.prod(gain)) / nl),
          growth_exponent_grad=-0.05,
        )
      mw.write(rec)
      if wind_tunnel and (step % eval_every == 0 or step == steps):
        kl = max(1e-3, kl_scale * (loss - floor) / math.log(2)) if math.isfinite(loss) else math.nan
        mw.write(
          {
            "step": step,
            "eval/loss": loss,
            "eval/kl_bits": kl,
            "eval/entropy_gap_bits": 0.5 * kl,
            "eval/accuracy": 0.9,
            "eval/ece": 0.02,
            "eval/kl_bits_by_pos": [kl] * 6,
          }
        )
      if halt_at is not None and step >= halt_at and status == "failed":  # halted once diverged
        last = step
        break
  summary = {
    "status": "halted" if status == "failed" else "done",
    "steps": last,
    "final_loss": loss,
    "wall_s": 1.0,
    "params": {"total": 1000 * depth * width},
  }
  (run_dir / "summary.json").write_text(json.dumps(summary))
  return {"status": status, "steps": last}


def make_sweep(
  root: str | Path,
  *,
  mixers: Sequence[str] = ("residual", "hc", "mhc"),
  depths: Sequence[int] = (2, 4),
  lrs: Sequence[float] | None = (3e-3, 1e-2, 3e-2),
  widths: Sequence[int] = (32,),
  seeds: Sequence[int] = (0,),
  steps: int = 120,
  spike: tuple | None = ("mhc", 4, 1e-2, 80),
  diverge: tuple | None = ("hc", 4, 3e-2, 70),
  pending: bool = True,
  failed_empty: bool = False,
  wind_tunnel: bool = True,
  gain_metrics: str = "new",
) -> Path:
  """A sweep directory over mixers x depths (x widths x lrs x seeds where > 1 value)."""
  root = Path(root)
  root.mkdir(parents=True, exist_ok=True)
  lrs_ = list(lrs) if lrs else [1e-2]
  runs: dict[str, Any] = {}
  for m in mixers:
    for d in depths:
      for w in widths:
        for lr in lrs_:
          for s in seeds:
            name = _run_name(m, d, w, lr, s)
            ov: dict[str, Any] = {"model.mixer": m, "model.depth": d}
            if len(widths) > 1:
              ov["model.width"] = w
            if lrs and len(lrs_) > 1:
              ov["optim.lr"] = lr
            if len(seeds) > 1:
              ov["train.seed"] = s
            hit = lambda t: t is not None and (m, d, lr) == tuple(t[:3])  # noqa: E731
            info = write_run(
              root / "runs" / name,
              mixer=m,
              depth=d,
              width=w,
              lr=lr,
              seed=s,
              steps=steps,
              spike_at=spike[3] if hit(spike) else None,
              diverge_at=diverge[3] if hit(diverge) else None,
              wind_tunnel=wind_tunnel,
              gain_metrics=gain_metrics,
            )
            runs[name] = {"status": info["status"], "overrides": ov, "dir": f"runs/{name}"}
  if pending:
    ov = {"model.mixer": "mhc_lite", "model.depth": depths[0]}
    if lrs and len(lrs_) > 1:
      ov["optim.lr"] = lrs_[0]
    runs["mhc_lite_pending"] = {
      "status": "pending",
      "overrides": ov,
      "dir": "runs/mhc_lite_pending",
    }
  if failed_empty:
    ov = {"model.mixer": "mhc_lite", "model.depth": depths[-1]}
    if lrs and len(lrs_) > 1:
      ov["optim.lr"] = lrs_[-1]
    rdir = root / "runs" / "mhc_lite_failed"
    rdir.mkdir(parents=True)
    (rdir / "config.yaml").write_text(
      yaml.safe_dump({"model": {"mixer": "mhc_lite", "depth": depths[-1]}})
    )
    runs["mhc_lite_failed"] = {"status": "failed", "overrides": ov, "dir": "runs/mhc_lite_failed"}
  (root / "manifest.json").write_text(json.dumps({"runs": runs}, indent=1))
  return root


def raw_records(path: str | Path) -> list[dict[str, Any]]:
  """Plain ``json`` reading of a JSONL file (no mhc_jax code), for independent checks."""
  return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
