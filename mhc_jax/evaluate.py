"""``mhc-jax eval --run DIR [--batches N]``: posterior fidelity and geometry probes of a trained run.

The latest checkpoint in ``DIR/checkpoints`` on ``N`` validation batches (those the trainer's
in-loop eval starts with) into ``DIR/eval.json`` (docs/windtunnel_results.md, "What eval.json
holds"), a summary on stdout; ``--series``: every kept checkpoint and step 0 (or ``--steps``), a
row each in ``DIR/geometry_series.csv`` (ibid., "The checkpoint series"). Probes:
:mod:`mhc_jax.geometry`. Bad input (no such directory, config.yaml or checkpoint, an invalid
config, ``--batches < 1``, a step not kept): one ``error:`` line, exit 2.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from mhc_jax import posterior as P, storage
from mhc_jax.errors import ConfigError, UsageError
from mhc_jax.geometry import probes, readout, series
from mhc_jax.model import Transformer
from mhc_jax.train import checkpoint, sharding as sh
from mhc_jax.train.config import MeshConfig, load_config
from mhc_jax.train.loop import check_data, host_batch
from mhc_jax.train.optim import make_optimizer
from mhc_jax.train.state import abstract_state, state_shardings
from mhc_jax.train.step import token_loss

FILTERING_FACTOR = 10  # filtering counts only at KL <= header-only baseline / 10
SERIES_CSV = "geometry_series.csv"  # `mhc-jax eval --series`: one row per checkpoint


def _open_run(run_dir, batches: int):
  """(path, cfg, source, mesh, model, abstract state, Checkpoints, checkpoint steps) of a run
  dir, ``batches`` checked first."""
  if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
    raise UsageError(f"--batches must be a positive integer, got {batches!r}")
  run = storage.path(run_dir)
  if not run.exists():
    raise UsageError(f"--run: {run} does not exist")
  if not run.is_dir():
    raise UsageError(f"--run: {run} is not a directory")
  if not (run / "config.yaml").is_file():
    raise UsageError(f"--run: {run} is not a run directory (no config.yaml)")
  ck_dir = run / "checkpoints"
  if not ck_dir.is_dir() or not any(p.name.isdigit() for p in ck_dir.iterdir()):
    raise UsageError(
      f"--run: {run} has no checkpoint in {ck_dir} (train with train.ckpt_every, "
      f"or let the run finish: it saves one at the end)"
    )
  try:
    cfg = load_config(run / "config.yaml")
  except ConfigError as e:
    raise ConfigError(f"{run / 'config.yaml'}: {e}") from None
  cfg, source = check_data(cfg)
  try:  # the run's mesh when it fits this machine's devices, else a single-device one
    mesh = sh.make_mesh(cfg.mesh, cfg.data.batch_size)
  except ConfigError:
    mesh = sh.make_mesh(MeshConfig(data=1), None, devices=jax.devices()[:1])
  model = Transformer(cfg.model)
  tx, _ = make_optimizer(cfg.optim, cfg.train.steps, model=cfg.model)
  example = jnp.zeros((1, cfg.data.seq_len), jnp.int32)
  abstract = abstract_state(state_shardings(model, example, tx, mesh), model, example, tx)
  # through the module, not a name bound at import: tests patch checkpoint.Checkpoints
  ckpt = checkpoint.Checkpoints(ck_dir, keep=None, async_save=False)
  steps = sorted(int(s) for s in ckpt.mngr.all_steps())
  if not steps:
    ckpt.close()
    raise UsageError(f"--run: {run} has no complete checkpoint in {ck_dir}")
  return run, cfg, source, mesh, model, abstract, ckpt, steps


def _restore_params(ckpt, abstract, step: int, run: Path):
  try:
    state, _ = ckpt.restore(abstract, step)
  except Exception as e:  # orbax raises many kinds; the first line says what went wrong
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    raise UsageError(
      f"--run: cannot restore checkpoint {step} of {run} ({type(e).__name__}: {first})"
    ) from None
  return state.params


_FORWARD_FNS: dict = {}


def _forward_fns(model, cfg):
  """Jitted (logits, loss, count) of a batch, and the model's sown intermediates; one pair per
  model config and target in a process (an arm's seeds compile them once)."""
  key = (repr(model.cfg), cfg.data.target)
  if key in _FORWARD_FNS:
    return _FORWARD_FNS[key]

  def fwd(params, batch):
    logits, _ = model.apply(params, batch["inputs"], stats=False)
    loss, _ = token_loss(logits, batch, cfg.data.target)
    return logits, loss, jnp.sum(batch["mask"])

  def inter(params, tokens):
    capture = lambda mdl, name: mdl.name == "value" and name == "__call__"
    _, st = model.apply(params, tokens, mutable=["intermediates"], capture_intermediates=capture)
    return st["intermediates"]

  _FORWARD_FNS[key] = jax.jit(fwd), jax.jit(inter)
  return _FORWARD_FNS[key]


def pad_vocab(dist: np.ndarray, vocab: int) -> np.ndarray:
  """Zero-pad distributions over the data's vocabulary to the model's (which may be larger)."""
  extra = vocab - dist.shape[-1]
  if extra < 0:
    raise ValueError(f"model vocabulary {vocab} is smaller than the data's {dist.shape[-1]}")
  return dist if extra == 0 else np.pad(dist, [(0, 0)] * (dist.ndim - 1) + [(0, extra)])


def kl_bits_dist(p: np.ndarray, q: np.ndarray) -> np.ndarray:
  """KL(p || q) in bits per row of two distributions (float64; 0 log 0 = 0), [...]."""
  p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
  on = p > 0
  with np.errstate(divide="ignore"):
    terms = np.where(on, p * (np.log2(np.where(on, p, 1.0)) - np.log2(np.where(on, q, 1.0))), 0.0)
  return np.maximum(terms.sum(-1), 0.0)


def fidelity(host_batches: list[dict], logits: list[np.ndarray], source) -> dict:
  """posterior.fidelity_metrics over all batches at once, every baseline of
  ``source.baselines`` scored on the same positions and, on HMM filtering, the verdict."""
  keys = ("posterior", "mask", "evidence", "inputs")
  cat = {k: np.concatenate([b[k] for b in host_batches]) for k in keys}
  lg = np.concatenate(logits)
  cat["posterior"] = pad_vocab(cat["posterior"], lg.shape[-1])
  mask, G = cat["mask"], int(cat["evidence"].max()) + 1
  fm = jax.device_get(
    P.fidelity_metrics({k: cat[k] for k in ("posterior", "mask", "evidence")}, lg, num_groups=G)
  )
  names = ("kl_bits", "entropy_gap_bits", "accuracy", "ece")
  scalars = names + ("posterior_entropy_bits", "model_entropy_bits")
  out: dict[str, Any] = {k: float(fm[k]) for k in scalars}
  sup = mask > 0
  out["baselines"] = {}
  for name, dist in source.baselines(cat["inputs"]).items():
    kl = kl_bits_dist(cat["posterior"], pad_vocab(dist, lg.shape[-1])) * sup
    out["baselines"][name] = {
      "kl_bits": float(kl.sum() / max(float(mask.sum()), 1.0)),
      "kl_bits_by_evidence": probes.mean_by_group(kl[sup], cat["evidence"][sup], G),
    }
  out["kl_bits_uniform"] = out["baselines"]["uniform"]["kl_bits"]
  if getattr(source, "predict", None) == "state":  # HMM filtering
    hdr = out["baselines"]["header_only"]["kl_bits"]
    out["filtering"] = {
      "criterion": f"kl_bits <= header_only / {FILTERING_FACTOR}",
      "threshold_bits": hdr / FILTERING_FACTOR,
      "reached": bool(out["kl_bits"] <= hdr / FILTERING_FACTOR),
      "kl_over_header_only": out["kl_bits"] / hdr if hdr > 0 else float("nan"),
      "beats_last_obs": bool(out["kl_bits"] < out["baselines"]["last_obs"]["kl_bits"]),
    }
  for g in ("evidence", "position"):
    out[f"by_{g}"] = {k: np.asarray(fm[f"{k}_by_{g}"], np.float64) for k in names + ("count",)}
  out["positions"] = int(mask.sum())
  return out


def _batches(source, cfg, mesh, n: int):
  host_b = [host_batch(source, cfg, i, split="validation") for i in range(n)]
  return host_b, [sh.put_batch(b, mesh) for b in host_b]


def _score(fwd, params, dev_b, keep_logits: bool):
  """(mean loss per supervised position, positions, the logits where ``keep_logits``)."""
  logits, loss_sum, count = [], 0.0, 0.0
  for d in dev_b:
    lg, loss, n = fwd(params, d)
    loss, n = jax.device_get((loss, n))
    if keep_logits:
      logits.append(np.asarray(jax.device_get(lg)))
    loss_sum += float(loss) * float(n)
    count += float(n)
  return loss_sum / max(count, 1.0), count, logits


def evaluate_run(run_dir: str | os.PathLike, batches: int = 8) -> dict:
  """Evaluate a run directory's latest checkpoint; returns what eval.json holds."""
  t0 = time.perf_counter()
  run, cfg, source, mesh, model, abstract, ckpt, steps = _open_run(run_dir, batches)
  try:
    restore = lambda step: _restore_params(ckpt, abstract, step, run)
    params = restore(steps[-1])
    fwd, inter = _forward_fns(model, cfg)
    host_b, dev_b = _batches(source, cfg, mesh, batches)
    eval_loss, count, logits = _score(fwd, params, dev_b, source.has_posterior)
    result: dict[str, Any] = {"run": str(run), "task": cfg.data.task, "step": steps[-1]}
    result |= {"checkpoint_steps": steps, "batches": batches, "batch_size": cfg.data.batch_size}
    result |= {"seq_len": cfg.data.seq_len, "mixer": cfg.model.mixer, "target": cfg.data.target}
    if not source.has_posterior:
      bits = eval_loss / math.log(2)
      result["metrics"] = {"eval_loss": eval_loss, "bits_per_byte": bits, "positions": int(count)}
    else:
      result["metrics"] = {"eval_loss": eval_loss, **fidelity(host_b, logits, source)}
      k = min(batches, readout.PROBE_BATCHES)
      probes_out = readout.geometry(cfg, source, params, inter, host_b[:k], dev_b[:k])
      logits_fn = lambda p, d: np.asarray(jax.device_get(fwd(p, d)[0]), np.float64)
      probes_out["paper"]["frame_precision"] = readout.checkpoint_probes(
        cfg.model.depth, params, logits_fn, inter, restore, steps, host_b[0], dev_b[0]
      )
      result["probes"] = probes_out
  finally:
    ckpt.close()
  result["wall_s"] = time.perf_counter() - t0
  return result


def evaluate_series(run_dir: str | os.PathLike, batches: int = 8, steps=None) -> list[dict]:
  """A row per kept checkpoint and step 0 (the run's initialisation: the random-init control),
  or per step in `steps`: eval loss, KL, :mod:`mhc_jax.geometry.series`' columns, the gated M,
  attention's distance to the last row's (docs/windtunnel_results.md, "The checkpoint series")."""
  run, cfg, source, mesh, model, abstract, ckpt, kept = _open_run(run_dir, batches)
  rows, attn = [], []
  try:
    if not source.has_posterior:
      raise UsageError(f"--series: {run} is not a wind-tunnel run (no exact posterior)")
    if missing := sorted(set(steps or ()) - set(kept) - {0}):
      raise UsageError(f"--steps: {run} kept no checkpoint at {missing} (kept: {kept})")
    fwd, inter = _forward_fns(model, cfg)
    host_b, dev_b = _batches(source, cfg, mesh, batches)
    # probes: bijection keys with replacement, every key supervised (whatever the run's layout)
    bij = cfg.data.task == "bijection"
    probe = dataclasses.replace(source, replacement=True, supervise="all") if bij else source
    probe_b = _batches(probe, cfg, mesh, readout.PROBE_BATCHES)
    cat = {k: np.concatenate([b[k] for b in host_b]) for k in ("inputs", "posterior", "mask")}
    example = jnp.zeros((1, cfg.data.seq_len), jnp.int32)
    for s in sorted(set(steps) if steps else {0, *kept}):
      if s == 0 and 0 not in kept:  # the trainer's initialisation (train.state.init_fn)
        params = nn.meta.unbox(model.init(jax.random.PRNGKey(cfg.train.seed), example))
      else:
        params = _restore_params(ckpt, abstract, s, run)
      loss, _, logits = _score(fwd, params, dev_b, True)
      it, hb, entropy = readout.probe_arrays(cfg, params, inter, *probe_b)
      attn.append(it["attn"])
      fid = fidelity(host_b, logits, source)
      row = {"step": s, "eval_loss": loss, "kl_bits": fid["kl_bits"]}
      row |= series.signatures(cfg, probe, params, it, hb, entropy)
      lg = np.concatenate(logits)
      row |= series.formation(
        cfg, source, model, params, cat["inputs"], lg, cat["posterior"], cat["mask"],
        fid["kl_bits"], fid["kl_bits_uniform"],
      )  # fmt: skip
      rows.append(row | {"M_gated": bool(row["M"] and row["learned"])})
  finally:
    ckpt.close()
  for r, a in zip(rows, attn):
    r["frame_dist"] = float(0.5 * np.abs(a - attn[-1]).sum(-1).mean())
  return rows


def summary_lines(r: dict) -> list[str]:
  """The few lines ``mhc-jax eval`` prints about an eval.json dict."""
  m = r["metrics"]
  lines = [
    f"eval of {r['run']} at step {r['step']} ({r['task']}, {r['batches']} validation "
    f"batches of {r['batch_size']})"
  ]
  if "kl_bits" not in m:
    lines.append(f"  eval loss {m['eval_loss']:.4f} nats/byte = {m['bits_per_byte']:.4f} bits/byte")
    return lines
  lines.append(
    f"  KL {m['kl_bits']:.4f} bits/position  entropy gap {m['entropy_gap_bits']:.4f}"
    f"  accuracy {m['accuracy']:.3f}  ECE {m['ece']:.3f}  eval loss {m['eval_loss']:.4f}"
  )
  named = (f"{name.replace('_', '-')} {b['kl_bits']:.4f}" for name, b in m["baselines"].items())
  lines.append("  baselines, KL bits/position: " + ", ".join(named))
  if f := m.get("filtering"):
    lines.append(
      f"  filtering (KL <= header-only/10 = {f['threshold_bits']:.4f}): "
      f"{'reached' if f['reached'] else 'NOT reached'}; "
      f"KL is {f['kl_over_header_only']:.3f} x header-only; "
      f"{'beats' if f['beats_last_obs'] else 'does NOT beat'} the last-observation guess"
    )
  p = r.get("probes", {})
  ko, qk = p.get("key_orthogonality", {}), p.get("qk_alignment", {})
  pc, fp = p.get("pca_entropy", {}), p.get("paper", {}).get("frame_precision", {})
  bits = []
  if "mean_abs_cos" in ko:
    x = "{mean_abs_cos:.3f} = {ratio_to_random:.2f} x random"
    rh = f" (retrieval head {x.format(**ko['retrieval_head'])})" if "retrieval_head" in ko else ""
    bits.append("keys (pre-RoPE) mean |cos| " + x.format(**ko) + rh)
  if "slope" in qk:
    bits.append(
      f"retrieval head L{qk['layer']}H{qk['head']} attn on target {qk['attn_on_target']:.2f}, "
      f"pre-RoPE q-k cos slope {qk['slope']:+.4f}/evidence at fixed distance"
    )
  if "corr_pc1_entropy" in pc:
    bits.append(f"PC1 vs entropy, position partialled out: r = {pc['corr_pc1_entropy']:+.3f}")
  if "frame_before_manifold" in fp:
    bits.append(
      f"attention settles before the value manifold: {'yes' if fp['frame_before_manifold'] else 'no'}"
      f" (steps {fp['frame_settled_step']} and {fp['manifold_settled_step']})"
    )
  return lines + (["  " + "; ".join(bits)] if bits else [])


def main(args) -> int:
  run = storage.path(args.run)
  if getattr(args, "series", False):
    import pandas as pd

    steps = getattr(args, "steps", None)
    if steps and not all(x.strip().isdigit() for x in steps.split(",")):
      raise UsageError(f"--steps: expected comma-separated steps, got {steps!r}")
    rows = evaluate_series(run, args.batches, [int(x) for x in steps.split(",")] if steps else None)
    df = pd.DataFrame(rows)
    storage.write_text_atomic(run / SERIES_CSV, df.to_csv(index=False))
    cols = ["step", "kl_bits", "mae", "frame_ratio", "key_cos", "key_cos_null", "value_r_new_wp_z"]
    print(
      df[[c for c in cols + ["M_gated"] if c in df]].to_string(index=False, float_format="%.4f")
    )
    done = ", ".join(str(r["step"]) for r in rows)
    print(f"wrote {run / SERIES_CSV} ({len(rows)} rows: steps {done})")
    return 0
  result = evaluate_run(run, getattr(args, "batches", 8))
  storage.write_json_atomic(run / "eval.json", result)
  print("\n".join(summary_lines(result)))
  print(f"wrote {run / 'eval.json'} ({result['wall_s']:.1f}s)")
  return 0
