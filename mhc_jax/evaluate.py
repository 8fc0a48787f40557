"""``mhc-jax eval --run DIR [--batches N]``: posterior fidelity and geometry probes of a trained run.

Loads ``DIR/config.yaml`` and the latest orbax checkpoint in ``DIR/checkpoints`` and writes
``DIR/eval.json`` (atomically), with a short summary on stdout.

Wind tunnels (bijection, hmm), on ``N`` validation batches (batch ``i`` of the ``validation``
split, the same batches the trainer's in-loop eval starts with):

- ``metrics``: ``eval_loss`` (the training loss, in nats, against ``data.target``),
  ``kl_bits`` (KL(posterior || model) in bits per supervised position, the primary metric),
  ``entropy_gap_bits``, ``accuracy``, ``ece``, ``posterior_entropy_bits``,
  ``model_entropy_bits``, and curves ``by_evidence`` / ``by_position`` (``kl_bits``,
  ``entropy_gap_bits``, ``accuracy``, ``ece``, ``count``; NaN where a group has no position), all
  from :func:`mhc_jax.posterior.fidelity_metrics` over all N batches at once.
  ``baselines``: for each exact reference guess of the task (``source.baselines``: bijection
  ``uniform``; HMM ``uniform``, ``header_only``, ``header_blind``, ``last_obs``) its
  ``kl_bits`` on the same positions and ``kl_bits_by_evidence``; ``kl_bits_uniform`` repeats
  the uniform one. HMM filtering (``predict: state``) adds ``filtering``: the criterion
  (KL <= header-only / 10), its ``threshold_bits``, whether it is ``reached``, the KL as a
  fraction of the header-only baseline, and whether the model ``beats_last_obs`` (uses more than
  the latest observation).
- ``probes`` (on the first ``min(N, 2)`` batches; :mod:`mhc_jax.probes`); each says in
  ``controls`` which confound it controls for (also listed once in ``probes.controls``):

  - ``key_orthogonality``: attention keys **before RoPE** grouped by hypothesis, per layer (all
    heads concatenated, globally centred), each layer with the mean |cos| of as many random
    directions in its dimension (``random_mean_abs_cos_by_layer``) and the ratio
    (``ratio_to_random_by_layer``; ~1 = no more orthogonal than chance). Bijection: keys at value
    tokens, hypothesis = the key symbol that value answers; also for the retrieval head alone
    (``retrieval_head``). HMM: keys at observation tokens, grouped by the observed symbol (hidden
    states are relabelled in every sequence, so they are no hypothesis shared across sequences).
  - ``qk_alignment`` (bijection): for queries whose key was seen before, the position that holds
    the answer (the value token after the key's previous occurrence) is the target; the (layer,
    head) with the most attention on targets is the retrieval head. The cosine between its query
    and the target's key, both **before RoPE**, by evidence; ``slope`` is its slope against
    evidence **within groups of equal query-target distance** (``slope_unconditioned`` without
    that, ``slope_old_definition`` after RoPE and unconditioned, for comparison), with the
    attention weight on the target by evidence. HMM: skipped (no single target position).
  - ``pca_entropy``: PCA of the residual stream (streams summed) after each block against the
    posterior entropy in bits, **position partialled out** of both (demeaned within each
    position), on bijection **new-key positions only** (at seen keys the entropy is 0: that
    binary flag is most of the entropy variance); HMM: all supervised positions. Explained
    variance, correlation of PC1..PC3 with the entropy (sign arbitrary), per layer; the summary
    is the last block. ``abs_corr_pc1_entropy_old_definition``: the old figure (all supervised
    positions, nothing partialled out), for comparison.
  - ``drift`` (needs 5+ checkpoints, the first no later than half-way to the last): attention
    probabilities and value vectors of every layer on the first validation batch at each
    checkpoint; **norm-free** rates per 1000 steps (total variation of attention rows, angle of
    value vectors) and whether attention settles first (see ``probes.drift``).

  - ``paper``: the same signatures by the papers' own definitions, each against its null
    (``PAPER_DEFINITIONS``; docs/windtunnel_results.md gives the sources): ``key_orthogonality``
    (token keys per head vs random directions; W_K columns), ``qk_alignment`` (per layer, slope
    against evidence vs permuted evidence), ``value_manifold`` (standardised last-layer values,
    PC1 vs entropy vs permuted entropy) and ``frame_precision`` (3+ checkpoints: whether the
    attention patterns settle before the value manifold and the KL).

Text tasks (text, tfds; no posterior): ``eval_loss`` (nats per byte) and ``bits_per_byte``.

Bad input (no such directory, no config.yaml, no checkpoint, a config that no longer validates,
``--batches < 1``) raises :class:`mhc_jax.cli.UsageError` or ``ConfigError``: one message, exit 2.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from mhc_jax import storage

PROBE_BATCHES = 2  # validation batches the geometry probes use
PCA_MAX_POINTS = 4096


# --------------------------------------------------------------------------------- loading


def _usage(msg: str):
  from mhc_jax.errors import UsageError

  return UsageError(msg)


def load_run(run_dir: str | os.PathLike):
  """(cfg, source, mesh, model, abstract state, Checkpoints, checkpoint steps) of a run dir."""
  from mhc_jax.train.config import ConfigError, load_config

  run = storage.path(run_dir)
  if not run.exists():
    raise _usage(f"--run: {run} does not exist")
  if not run.is_dir():
    raise _usage(f"--run: {run} is not a directory")
  if not (run / "config.yaml").is_file():
    raise _usage(f"--run: {run} is not a run directory (no config.yaml)")
  ck_dir = run / "checkpoints"
  if not ck_dir.is_dir() or not any(p.name.isdigit() for p in ck_dir.iterdir()):
    raise _usage(
      f"--run: {run} has no checkpoint in {ck_dir} (train with train.ckpt_every, "
      f"or let the run finish: it saves one at the end)"
    )
  try:
    cfg = load_config(run / "config.yaml")
  except ConfigError as e:
    raise ConfigError(f"{run / 'config.yaml'}: {e}") from None

  import jax.numpy as jnp

  from mhc_jax import data
  from mhc_jax.model import Transformer
  from mhc_jax.train.checkpoint import Checkpoints
  from mhc_jax.train.config import with_data_vocab
  from mhc_jax.train.optim import make_optimizer
  from mhc_jax.train.state import abstract_state, state_shardings

  try:
    source = data.make_source(
      cfg.data.task, seq_len=cfg.data.seq_len, seed=cfg.train.seed, **cfg.data.options
    )
  except (ValueError, FileNotFoundError) as e:
    raise ConfigError(f"data.options: {e}") from None
  cfg = with_data_vocab(cfg, source.vocab_size)
  mesh = _eval_mesh(cfg)
  model = Transformer(cfg.model)
  tx, _ = make_optimizer(cfg.optim, cfg.train.steps)
  example = jnp.zeros((1, cfg.data.seq_len), jnp.int32)
  shard = state_shardings(model, example, tx, mesh)
  abstract = abstract_state(shard, model, example, tx)
  ckpt = Checkpoints(ck_dir, keep=None, async_save=False)
  steps = sorted(int(s) for s in ckpt.mngr.all_steps())
  if not steps:
    ckpt.close()
    raise _usage(f"--run: {run} has no complete checkpoint in {ck_dir}")
  return cfg, source, mesh, model, abstract, ckpt, steps


def _eval_mesh(cfg):
  """The run's mesh when it fits this machine's devices, else a single-device one."""
  import jax

  from mhc_jax.train import sharding as sh
  from mhc_jax.train.config import ConfigError, MeshConfig

  try:
    return sh.make_mesh(cfg.mesh, cfg.data.batch_size)
  except ConfigError:
    return sh.make_mesh(MeshConfig(data=1), None, devices=jax.devices()[:1])


def restore_params(ckpt, abstract, step: int, run: Path):
  try:
    state, _ = ckpt.restore(abstract, step)
  except Exception as e:  # orbax raises many kinds; the first line says what went wrong
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    raise _usage(
      f"--run: cannot restore checkpoint {step} of {run} ({type(e).__name__}: {first})"
    ) from None
  return state.params


# --------------------------------------------------------------------------------- metrics


def _forward_fns(model, cfg):
  import jax
  import jax.numpy as jnp

  from mhc_jax.train.step import token_loss

  def fwd(params, batch):
    logits, _ = model.apply(params, batch["inputs"], stats=False)
    loss, _ = token_loss(logits, batch, cfg.data.target)
    return logits, loss, jnp.sum(batch["mask"])

  def inter(params, tokens):
    (logits, _), st = model.apply(
      params,
      tokens,
      mutable=["intermediates"],
      capture_intermediates=lambda mdl, name: mdl.name == "value" and name == "__call__",
    )
    return st["intermediates"]

  return jax.jit(fwd), jax.jit(inter)


def _batches(source, cfg, n: int, mesh) -> list[dict]:
  from mhc_jax.train import sharding as sh
  from mhc_jax.train.loop import host_batch

  out = []
  for i in range(n):
    b = host_batch(source, cfg, i, split="validation")
    b.pop("plant", None)
    out.append((b, sh.put_batch(b, mesh)))
  return out


def pad_vocab(dist: np.ndarray, vocab: int) -> np.ndarray:
  """Zero-pad distributions over the data's vocabulary to the model's (model.vocab may exceed
  the data's: the extra tokens get no posterior mass)."""
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


def _mean_by(values: np.ndarray, mask: np.ndarray, groups: np.ndarray, G: int) -> np.ndarray:
  m = mask.reshape(-1) > 0
  g, v = groups.reshape(-1)[m], values.reshape(-1)[m]
  cnt = np.bincount(g, minlength=G).astype(np.float64)
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(cnt > 0, np.bincount(g, weights=v, minlength=G) / cnt, np.nan)


def baseline_kls(source, cat: dict, vocab: int, G: int) -> dict:
  """KL(posterior || baseline) of each of the source's exact baselines (``source.baselines``),
  mean over supervised positions and by evidence."""
  base = source.baselines(cat["inputs"])
  mask = cat["mask"]
  n = max(float(mask.sum()), 1.0)
  out = {}
  for name, dist in base.items():
    kl = kl_bits_dist(cat["posterior"], pad_vocab(dist, vocab)) * (mask > 0)
    out[name] = {
      "kl_bits": float(kl.sum() / n),
      "kl_bits_by_evidence": _mean_by(kl, mask, cat["evidence"], G),
    }
  return out


FILTERING_FACTOR = 10  # filtering counts only at KL <= header-only baseline / 10


def fidelity(host_batches: list[dict], logits: list[np.ndarray], source=None) -> dict:
  """posterior.fidelity_metrics over all batches at once, plus the baselines' KL.

  With ``source`` (a wind tunnel), every baseline of ``source.baselines`` is scored on the same
  positions (``baselines``); HMM filtering adds the verdict ``filtering``. Without it only the
  uniform guess over the answer symbols is (``kl_bits_uniform``, kept in both cases)."""
  import jax

  from mhc_jax import posterior as P

  keys = ("posterior", "mask", "evidence") + (("inputs",) if source is not None else ())
  cat = {k: np.concatenate([b[k] for b in host_batches]) for k in keys}
  lg = np.concatenate(logits)
  cat["posterior"] = pad_vocab(cat["posterior"], lg.shape[-1])
  G = int(cat["evidence"].max()) + 1
  fm = jax.device_get(
    P.fidelity_metrics({k: cat[k] for k in ("posterior", "mask", "evidence")}, lg, num_groups=G)
  )
  out = {
    k: float(fm[k])
    for k in (
      "kl_bits",
      "entropy_gap_bits",
      "accuracy",
      "ece",
      "posterior_entropy_bits",
      "model_entropy_bits",
    )
  }
  if source is not None and hasattr(source, "baselines"):
    out["baselines"] = baseline_kls(source, cat, lg.shape[-1], G)
    out["kl_bits_uniform"] = out["baselines"]["uniform"]["kl_bits"]
  else:  # uniform guess over the answer symbols (every token the posterior ever gives mass to)
    support = (cat["posterior"] * cat["mask"][..., None]).reshape(-1, lg.shape[-1]).max(0) > 0
    uni = np.where(support, 0.0, -1e9).astype(np.float32)
    out["kl_bits_uniform"] = float(
      P.kl_bits(cat["posterior"], np.broadcast_to(uni, lg.shape), cat["mask"])
    )
  if getattr(source, "predict", None) == "state":
    hdr = out["baselines"]["header_only"]["kl_bits"]
    last = out["baselines"]["last_obs"]["kl_bits"]
    out["filtering"] = {
      "criterion": f"kl_bits <= header_only / {FILTERING_FACTOR}",
      "threshold_bits": hdr / FILTERING_FACTOR,
      "reached": bool(out["kl_bits"] <= hdr / FILTERING_FACTOR),
      "kl_over_header_only": out["kl_bits"] / hdr if hdr > 0 else float("nan"),
      "beats_last_obs": bool(out["kl_bits"] < last),
    }
  for g in ("evidence", "position"):
    out[f"by_{g}"] = {
      k: np.asarray(fm[f"{k}_by_{g}"], np.float64)
      for k in ("kl_bits", "entropy_gap_bits", "accuracy", "ece")
    }
    out[f"by_{g}"]["count"] = np.asarray(fm[f"count_by_{g}"], np.float64)
  out["positions"] = int(cat["mask"].sum())
  return out


# --------------------------------------------------------------------------------- probes


def stacked_intermediates(inter: dict, depth: int) -> dict[str, np.ndarray]:
  """Model intermediates as numpy arrays with a leading layer axis, scanned or not.

  Returns ``stream [L,B,T,n,C]``, ``q``/``k`` (after RoPE), ``q_pre``/``k_pre`` (before RoPE;
  the same as ``q``/``k`` for a model that does not sow them) and ``value [L,B,T,H,D]``,
  ``attn [L,B,H,T,S]``.
  """
  import jax

  def unpack(tree):
    a = tree["attn"]
    return {
      "stream": tree["stream"][0],
      "q": a["q"][0],
      "k": a["k"][0],
      "attn": a["attn"][0],
      "q_pre": a.get("q_pre_rope", a["q"])[0],
      "k_pre": a.get("k_pre_rope", a["k"])[0],
      "value": a["value"]["__call__"][0],
    }

  inter = jax.device_get(inter)
  if "blocks" in inter:
    return {k: np.asarray(v) for k, v in unpack(inter["blocks"]).items()}
  per = [unpack(inter[f"block_{l}"]) for l in range(depth)]
  return {k: np.stack([np.asarray(p[k]) for p in per]) for k in per[0]}


def _cat_inter(parts: list[dict]) -> dict:
  """Concatenate per-batch intermediates along the batch axis (axis 1)."""
  return {k: np.concatenate([p[k] for p in parts], axis=1) for k in parts[0]}


def bijection_targets(inputs: np.ndarray, mask: np.ndarray, n_symbols: int) -> np.ndarray:
  """For each supervised key position, the input position of the value that answers it when the
  key occurred before (the value token after its latest earlier occurrence), else -1. [B,T]."""
  B, T = inputs.shape
  tgt = np.full((B, T), -1, np.int64)
  for b in range(B):
    last: dict[int, int] = {}
    for t in range(T):
      if mask[b, t] <= 0:
        continue
      k = int(inputs[b, t])
      if k in last and last[k] + 1 < T:
        tgt[b, t] = last[k] + 1
      last[k] = t
  return tgt


CONTROLS = {
  "key_orthogonality": "keys read before RoPE (the rotation depends on position, not content); "
  "every layer's mean |cos| has a random-direction reference (as many "
  "random directions in the same dimension, centred alike) and the ratio",
  "qk_alignment": "q and k read before RoPE; slope of cos against evidence taken within groups "
  "of equal query-target distance (evidence grows with distance)",
  "pca_entropy": "bijection: only new-key positions (the 'key seen before' flag is most of the "
  "entropy variance); position partialled out of states and entropy (fixed "
  "effects) before PCA and correlation",
  "drift": "needs 5+ checkpoints spread through training; norm-free measures (total "
  "variation of attention rows, angle of value vectors) per 1000 steps",
}


def key_orthogonality_probe(
  k: np.ndarray, positions, hyp: np.ndarray, grouping: str, head: tuple[int, int] | None = None
) -> dict:
  """Keys [L,B,T,H,D] (before RoPE) at `positions` grouped by `hyp`: per layer with all heads
  concatenated, each with its random-direction reference; the last layer as the summary, and
  (when given) the single (layer, head) `head`."""
  from mhc_jax import probes

  L = k.shape[0]
  bi, ti = positions
  if len(np.unique(hyp)) < 2:
    return {"grouping": grouping, "skipped": "fewer than two hypotheses in the probe batches"}
  per_layer = [
    probes.key_orthogonality(k[l][bi, ti].reshape(len(bi), -1), hyp, center=True) for l in range(L)
  ]
  last = per_layer[-1]
  out = {
    "grouping": grouping,
    "reads": "keys before RoPE",
    "controls": CONTROLS["key_orthogonality"],
    "layer": L - 1,
    "hypotheses": int(len(last["hypotheses"])),
    "points": int(len(bi)),
    "mean_abs_cos": last["mean_abs_cos"],
    "max_abs_cos": last["max_abs_cos"],
    "within_cos": last["within_cos"],
    "random_mean_abs_cos": last["random_mean_abs_cos"],
    "ratio_to_random": last["ratio_to_random"],
    "mean_abs_cos_by_layer": [r["mean_abs_cos"] for r in per_layer],
    "random_mean_abs_cos_by_layer": [r["random_mean_abs_cos"] for r in per_layer],
    "ratio_to_random_by_layer": [r["ratio_to_random"] for r in per_layer],
    "within_cos_by_layer": [r["within_cos"] for r in per_layer],
  }
  if head is not None:
    l, h = head
    r = probes.key_orthogonality(k[l][bi, ti, h], hyp, center=True)
    out["retrieval_head"] = {
      "layer": int(l),
      "head": int(h),
      "mean_abs_cos": r["mean_abs_cos"],
      "max_abs_cos": r["max_abs_cos"],
      "within_cos": r["within_cos"],
      "random_mean_abs_cos": r["random_mean_abs_cos"],
      "ratio_to_random": r["ratio_to_random"],
    }
  return out


def qk_alignment_probe(it: dict, tgt: np.ndarray, evidence: np.ndarray, G: int) -> dict:
  from mhc_jax import probes

  bi, ti = np.nonzero(tgt >= 0)
  if len(bi) < 2:
    return {"skipped": "no query whose key was seen before (bijection with replacement=false?)"}
  si = tgt[bi, ti]
  attn = it["attn"]  # [L,B,H,T,S]
  on_target = attn[:, bi, :, ti, si]  # [N, L, H] (advanced indices first)
  on_target = np.moveaxis(on_target, 0, -1)  # [L, H, N]
  mean_on = on_target.mean(-1)
  layer, head = np.unravel_index(int(np.argmax(mean_on)), mean_on.shape)
  ev = evidence[bi, ti]
  dist = ti - si
  r = probes.qk_alignment_by_evidence(
    it["q_pre"][layer][bi, ti, head],
    it["k_pre"][layer][bi, si, head],
    ev,
    num_groups=G,
    distance=dist,
  )
  old = probes.qk_alignment_by_evidence(
    it["q"][layer][bi, ti, head], it["k"][layer][bi, si, head], ev, num_groups=G
  )
  a = on_target[layer, head]
  cnt = np.bincount(ev, minlength=G).astype(np.float64)
  with np.errstate(invalid="ignore", divide="ignore"):
    attn_by_ev = np.where(cnt > 0, np.bincount(ev, weights=a, minlength=G) / cnt, np.nan)
  return {
    "reads": "q and k before RoPE",
    "controls": CONTROLS["qk_alignment"],
    "layer": int(layer),
    "head": int(head),
    "points": int(len(bi)),
    "attn_on_target": float(a.mean()),
    "attn_on_target_by_layer_head": mean_on,
    "cos_mean": float(r["cos"].mean()),
    "alignment_by_evidence": r["alignment"],
    "alignment_by_evidence_distance_adjusted": r["alignment_adjusted"],
    "attn_on_target_by_evidence": attn_by_ev,
    "count_by_evidence": r["count"],
    "slope": r["slope"],
    "slope_unconditioned": r["slope_raw"],
    "distance_groups": r["distance_groups"],
    "slope_old_definition": old["slope_raw"],  # after RoPE, not conditioned on distance
  }


def pca_probe(
  stream: np.ndarray, positions, entropy: np.ndarray, seed: int = 0, old_positions=None
) -> dict:
  """PCA of the residual stream at `positions` after each block vs the entropy, position
  partialled out; `old_positions` (all supervised positions) gives the old, unconditioned
  figure for comparison."""
  from mhc_jax import probes

  rng = np.random.default_rng(seed)

  def subsample(bi, ti):
    if len(bi) > PCA_MAX_POINTS:
      sel = np.sort(rng.choice(len(bi), PCA_MAX_POINTS, replace=False))
      return bi[sel], ti[sel]
    return bi, ti

  bi, ti = subsample(*positions)
  h = entropy[bi, ti]
  if len(bi) < 3 or np.std(probes.partial_out(h, strata=ti)) < 1e-9:
    return {
      "skipped": "the posterior entropy does not vary within a position on the probe positions"
    }
  per_layer = []
  for l in range(stream.shape[0]):
    X = stream[l][bi, ti].sum(axis=-2)  # streams summed: [N, C]
    per_layer.append(probes.pca_vs_entropy(X, h, k=3, strata=ti))
  last = per_layer[-1]
  out = {
    "controls": CONTROLS["pca_entropy"],
    "layer": stream.shape[0] - 1,
    "points": int(len(bi)),
    "entropy_std_within_position": last["entropy_std"],
    "explained_variance_ratio": last["explained_variance_ratio"],
    "corr_entropy": last["corr_entropy"],
    "corr_pc1_entropy": last["corr_pc1_entropy"],
    "abs_corr_pc1_entropy": last["abs_corr_pc1_entropy"],
    "abs_corr_pc1_entropy_by_layer": [r["abs_corr_pc1_entropy"] for r in per_layer],
    "max_abs_corr_pc123_entropy_by_layer": [
      float(np.max(np.abs(r["corr_entropy"]))) for r in per_layer
    ],
    "pc1_variance_by_layer": [float(r["explained_variance_ratio"][0]) for r in per_layer],
  }
  if old_positions is not None:
    ob, ot = subsample(*old_positions)
    oh = entropy[ob, ot]
    if np.std(oh) > 0:
      old = probes.pca_vs_entropy(stream[-1][ob, ot].sum(axis=-2), oh, k=3)
      out["abs_corr_pc1_entropy_old_definition"] = old["abs_corr_pc1_entropy"]
  return out


def drift_probe(series_attn: list[np.ndarray], series_value: list[np.ndarray], steps) -> dict:
  from mhc_jax import probes

  r = probes.drift(np.stack(series_attn), np.stack(series_value), steps)
  by_layer = [
    probes.drift(
      np.stack([a[l] for a in series_attn]), np.stack([v[l] for v in series_value]), steps
    )
    for l in range(series_attn[0].shape[0])
  ]
  return {
    "controls": CONTROLS["drift"],
    "steps": list(steps),
    "attn_drift": r["attn_drift"],
    "value_drift": r["value_drift"],
    "units": "attention: mean total-variation distance per 1000 steps; values: mean angle "
    "(radians) per 1000 steps",
    "attn_fall": r["attn_fall"],
    "value_fall": r["value_fall"],
    "attention_settles_first": r["attention_settles_first"],
    "attn_drift_by_layer": [d["attn_drift"] for d in by_layer],
    "value_drift_by_layer": [d["value_drift"] for d in by_layer],
    "attention_settles_first_by_layer": [d["attention_settles_first"] for d in by_layer],
    "attn_drift_relative_old_definition": r["attn_drift_relative"],
    "value_drift_relative_old_definition": r["value_drift_relative"],
  }


def drift_skip_reason(steps) -> str | None:
  """Why the drift probe cannot run on these checkpoint steps (None: it can): it needs
  MIN_DRIFT_CHECKPOINTS of them, the first no later than half-way to the last."""
  from mhc_jax.probes import MIN_DRIFT_CHECKPOINTS

  if len(steps) < MIN_DRIFT_CHECKPOINTS:
    return (
      f"needs {MIN_DRIFT_CHECKPOINTS}+ checkpoints spread through training, the run kept "
      f"{len(steps)} (set train.ckpt_every and train.keep_ckpts >= {MIN_DRIFT_CHECKPOINTS})"
    )
  if steps[0] > steps[-1] / 2:
    return (
      f"the kept checkpoints {list(steps)} cover only the end of training; the first must "
      f"be no later than half-way (raise train.ckpt_every)"
    )
  return None


def geometry(cfg, source, params, inter_fn, host_batches, dev_batches) -> dict:
  from mhc_jax.posterior import entropy_bits_pointwise

  it = _cat_inter(
    [stacked_intermediates(inter_fn(params, d["inputs"]), cfg.model.depth) for d in dev_batches]
  )
  hb = {k: np.concatenate([b[k] for b in host_batches]) for k in host_batches[0]}
  mask, inputs, evidence = hb["mask"], hb["inputs"], hb["evidence"].astype(np.int64)
  entropy = np.asarray(entropy_bits_pointwise(hb["posterior"])) * mask
  sup = np.nonzero(mask > 0)
  G = int(evidence.max()) + 1
  out: dict[str, Any] = {"batches": len(host_batches), "controls": CONTROLS}
  if cfg.data.task == "bijection":
    V = source.n_symbols
    vpos = np.nonzero((inputs >= V) & (inputs < 2 * V))
    vpos = (vpos[0][vpos[1] > 0], vpos[1][vpos[1] > 0])
    hyp = inputs[vpos[0], vpos[1] - 1]
    tgt = bijection_targets(inputs, mask, V)
    qk = qk_alignment_probe(it, tgt, evidence, G)
    head = (qk["layer"], qk["head"]) if "layer" in qk else None
    out["key_orthogonality"] = key_orthogonality_probe(
      it["k_pre"], vpos, hyp, "key symbol answered by the value token", head
    )
    out["qk_alignment"] = qk
    new_keys = np.nonzero((mask > 0) & (tgt < 0))
    out["pca_entropy"] = pca_probe(it["stream"], new_keys, entropy, old_positions=sup)
    out["pca_entropy"]["positions"] = "new keys (not seen before in the sequence)"
  else:  # hmm
    K = source.n_symbols
    h = source.header_len
    opos = np.nonzero((inputs < K) & (np.arange(inputs.shape[1])[None, :] >= h))
    out["key_orthogonality"] = key_orthogonality_probe(
      it["k_pre"], opos, inputs[opos], "observed symbol"
    )
    out["qk_alignment"] = {"skipped": "HMM filtering has no single target position to retrieve"}
    out["pca_entropy"] = pca_probe(it["stream"], sup, entropy, old_positions=sup)
    out["pca_entropy"]["positions"] = "all supervised positions"
  out["paper"] = {
    "key_orthogonality": key_orthogonality_paper(cfg, source, params),
    "qk_alignment": qk_alignment_paper(cfg, source, it, hb),
    "value_manifold": value_manifold_paper(cfg, source, it, hb, entropy),
  }
  return out


# ------------------------------------------------------------------ the papers' definitions

PAPER_PERMUTATIONS = 1000  # permutation draws of each shuffled-label null
PAPER_FIGURE_POINTS = 1500  # value-PCA points stored in eval.json for the figures

PAPER_DEFINITIONS = {
  "token_key_orthogonality": "Paper I (arXiv:2512.22471; authors' qkv_analysis.py "
  "orthogonality): keys of the hypothesis tokens' embeddings alone through each layer's "
  "pre-attention norm and key projection, per head, mean |cos| between tokens, uncentred; null: "
  "as many random directions in the head dimension",
  "weight_key_orthogonality": "Paper III (arXiv:2512.23752, Sec. 4.2): mean |cos| between the "
  "columns of each head's W_K; null: as many random directions in the model dimension",
  "qk_alignment": "Paper I (authors' qkv_analysis.py qk-align): cosine (pre-RoPE, per head, "
  "mean over heads) between the query at each supervised position and the keys at the earlier "
  "positions of the same kind, per layer; per query its mean over those keys ('mean') and, where "
  "the query's symbol occurred before, the key of that occurrence minus the mean of the others "
  "('contrast'); slope against evidence vs the evidence labels permuted",
  "value_manifold": "Paper III (Sec. 4.2): last-layer value vectors (heads concatenated) at "
  "the supervised positions, each coordinate standardised, PCA; PC1's variance share and its "
  "correlation with the posterior entropy vs the entropy labels permuted",
  "frame_precision": "Paper I: attention patterns (frame) settle before the value manifold "
  "(precision); settling step = where each series has covered 90% of its change for good",
}


def attention_params(params, depth: int) -> dict:
  """``embedding [V, C]`` and per layer ``key [L, C, H, D]`` (key kernels), ``norm [L, C]``
  (the pre-attention RMSNorm scale; None for a post-norm mixer) and ``k_norm [L, D]`` (qk-norm
  scale or None), scanned or not."""
  import jax

  p = jax.device_get(params)
  p = p.get("params", p)
  if "blocks" in p:
    blocks = [jax.tree.map(lambda a, l=l: np.asarray(a[l]), p["blocks"]) for l in range(depth)]
  else:
    blocks = [jax.tree.map(np.asarray, p[f"block_{l}"]) for l in range(depth)]

  def stack(get):
    vals = [get(b) for b in blocks]
    return None if vals[0] is None else np.stack(vals)

  return {
    "embedding": np.asarray(p["embedding"], np.float64),
    "key": stack(lambda b: b["attn"]["key"]["kernel"]),
    "norm": stack(lambda b: b["attn_norm"]["scale"] if "attn_norm" in b else None),
    "k_norm": stack(lambda b: b["attn"]["k_norm"]["scale"] if "k_norm" in b["attn"] else None),
  }


def _rms_normed(x: np.ndarray, scale) -> np.ndarray:
  y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)
  return y if scale is None else y * scale


def token_keys(ap: dict, tokens) -> np.ndarray:
  """The key ``[L, V, H, D]`` each token in ``tokens`` gets from its embedding alone at each
  layer (pre-attention norm, key projection, qk-norm; no position, no context)."""
  e = ap["embedding"][np.asarray(tokens)]
  out = []
  for l in range(ap["key"].shape[0]):
    x = e if ap["norm"] is None else _rms_normed(e, ap["norm"][l])
    k = np.einsum("vc,chd->vhd", x, ap["key"][l])
    if ap["k_norm"] is not None:
      k = _rms_normed(k, ap["k_norm"][l])
    out.append(k)
  return np.stack(out)


def hypothesis_tokens(cfg, source) -> tuple[np.ndarray, str]:
  """The tokens whose keys Paper I compares: bijection the V key symbols; HMM the content
  tokens (observation symbols and header levels: hidden states have no token of their own)."""
  if cfg.data.task == "bijection":
    return np.arange(source.n_symbols), "the key symbols"
  return np.arange(source.level_offset + source.n_levels), "observation symbols and levels"


def key_orthogonality_paper(cfg, source, params) -> dict:
  from mhc_jax import probes

  ap = attention_params(params, cfg.model.depth)
  toks, what = hypothesis_tokens(cfg, source)
  keys = token_keys(ap, toks)
  tok = [probes.token_key_orthogonality(keys[l]) for l in range(len(keys))]
  wk = [probes.weight_key_orthogonality(ap["key"][l]) for l in range(len(keys))]
  return {
    "definition": PAPER_DEFINITIONS["token_key_orthogonality"],
    "tokens": what,
    "layer0": {k: tok[0][k] for k in tok[0] if k != "cos"},
    "cos_layer0": tok[0]["cos"],
    "mean_abs_cos_by_layer": [r["mean_abs_cos"] for r in tok],
    "random_mean_abs_cos": tok[0]["random_mean_abs_cos"],
    "ratio_to_random_by_layer": [r["ratio_to_random"] for r in tok],
    "z_by_layer": [r["z"] for r in tok],
    "weights": {
      "definition": PAPER_DEFINITIONS["weight_key_orthogonality"],
      "mean_abs_cos_by_layer": [r["mean_abs_cos"] for r in wk],
      "random_mean_abs_cos": wk[0]["random_mean_abs_cos"],
      "ratio_to_random_by_layer": [r["ratio_to_random"] for r in wk],
    },
  }


def query_key_positions(cfg, source, inputs: np.ndarray, mask: np.ndarray):
  """Per sequence position: whether it is a query (supervised) and whether it is a key position
  of the same kind (bijection: key tokens; HMM: observations), ``[B, T]`` each, and for each
  query the position of the latest earlier occurrence of the same token (-1 if none)."""
  B, T = inputs.shape
  if cfg.data.task == "bijection":
    kind = (inputs < source.n_symbols) & (np.arange(T)[None] > 0)
  else:
    kind = (inputs < source.n_symbols) & (np.arange(T)[None] >= source.header_len)
  query = (mask > 0) & kind
  prev = np.full((B, T), -1, np.int64)
  for b in range(B):
    last: dict[int, int] = {}
    for t in np.nonzero(kind[b])[0]:
      tok = int(inputs[b, t])
      if query[b, t] and tok in last:
        prev[b, t] = last[tok]
      last[tok] = t
  return query, kind, prev


def qk_alignment_paper(cfg, source, it: dict, hb: dict) -> dict:
  """Paper I's q-k alignment per layer (PAPER_DEFINITIONS['qk_alignment'])."""
  from mhc_jax import probes

  inputs, mask = hb["inputs"], hb["mask"]
  ev = hb["evidence"].astype(np.int64)
  query, kind, prev = query_key_positions(cfg, source, inputs, mask)
  T = inputs.shape[1]
  earlier = kind[:, None, :] & (np.arange(T)[None, :, None] > np.arange(T)[None, None, :])
  qb, qt = np.nonzero(query & (earlier.sum(-1) > 0))
  if len(qb) < 3:
    return {"skipped": "fewer than 3 queries with an earlier key position"}
  e, pos = ev[qb, qt], qt
  within = np.std(probes.partial_out(e.astype(np.float64), strata=pos)) > 1e-9
  G = int(e.max()) + 1
  layers = []
  for l in range(it["q_pre"].shape[0]):
    q, k = _unit(it["q_pre"][l]), _unit(it["k_pre"][l])  # [B,T,H,D]
    cos = np.einsum("bthd,bshd->bts", q, k) / q.shape[2]  # mean over heads: [B,T,S]
    m = earlier[qb, qt]  # [N, S]
    c = cos[qb, qt]
    mean = (c * m).sum(-1) / m.sum(-1)
    rec = {
      "mean": float(mean.mean()),
      "mean_by_evidence": _group_mean(mean, e, G),
      "slope": probes.evidence_slope(mean, e, permutations=PAPER_PERMUTATIONS),
    }
    if within:
      rec["slope_within_position"] = probes.evidence_slope(
        mean, e, strata=pos, permutations=PAPER_PERMUTATIONS
      )
    n = np.nonzero((prev[qb, qt] >= 0) & (m.sum(-1) >= 2))[0]
    if len(n) >= 3:
      matched = c[n, prev[qb[n], qt[n]]]
      contrast = matched - ((c[n] * m[n]).sum(-1) - matched) / (m[n].sum(-1) - 1)
      rec["contrast"] = float(contrast.mean())
      rec["contrast_by_evidence"] = _group_mean(contrast, e[n], G)
      rec["contrast_slope"] = probes.evidence_slope(contrast, e[n], permutations=PAPER_PERMUTATIONS)
      if within:
        rec["contrast_slope_within_position"] = probes.evidence_slope(
          contrast, e[n], strata=pos[n], permutations=PAPER_PERMUTATIONS
        )
    layers.append(rec)
  return {
    "definition": PAPER_DEFINITIONS["qk_alignment"],
    "queries": int(len(qb)),
    "evidence_varies_within_position": bool(within),
    "count_by_evidence": np.bincount(e, minlength=G),
    "by_layer": layers,
  }


def _unit(x: np.ndarray) -> np.ndarray:
  x = np.asarray(x, np.float64)
  return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def _group_mean(v: np.ndarray, g: np.ndarray, G: int) -> np.ndarray:
  cnt = np.bincount(g, minlength=G).astype(np.float64)
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(cnt > 0, np.bincount(g, weights=v, minlength=G) / cnt, np.nan)


def value_manifold_paper(cfg, source, it: dict, hb: dict, entropy, seed: int = 0) -> dict:
  """Paper III's value manifold on the last layer (PAPER_DEFINITIONS['value_manifold']), with
  controls: position partialled out, and on bijection new keys only (their entropy is not the
  seen/unseen flag) with position partialled out."""
  from mhc_jax import probes

  mask = hb["mask"]
  v = it["value"][-1].reshape(mask.shape + it["value"].shape[-2:])  # [B*T,H,D] -> [B,T,H,D]
  bi, ti = np.nonzero(mask > 0)
  X = v[bi, ti].reshape(len(bi), -1)
  h = entropy[bi, ti]
  r = probes.value_manifold(X, h, permutations=PAPER_PERMUTATIONS, seed=seed)
  rng = np.random.default_rng(seed)
  keep = np.sort(rng.choice(len(h), min(len(h), PAPER_FIGURE_POINTS), replace=False))
  out = {
    "definition": PAPER_DEFINITIONS["value_manifold"],
    "layer": int(it["value"].shape[0] - 1),
    **{k: r[k] for k in r if k != "projections"},
    "figure": {"pc": r["projections"][keep], "entropy": h[keep], "position": ti[keep]},
  }
  controls = {}
  drop = ("projections",)
  if np.std(probes.partial_out(h, strata=ti)) > 1e-9:
    w = probes.value_manifold(X, h, strata=ti, permutations=PAPER_PERMUTATIONS, seed=seed)
    controls["within_position"] = {k: w[k] for k in w if k not in drop}
  if cfg.data.task == "bijection":
    _, _, prev = query_key_positions(cfg, source, hb["inputs"], mask)
    new = prev[bi, ti] < 0
    if new.sum() >= 3 and np.std(probes.partial_out(h[new], strata=ti[new])) > 1e-9:
      w = probes.value_manifold(
        X[new], h[new], strata=ti[new], permutations=PAPER_PERMUTATIONS, seed=seed
      )
      controls["new_keys_within_position"] = {k: w[k] for k in w if k not in drop}
  out["controls"] = controls
  return out


def frame_dist(attn_series: list[np.ndarray]) -> np.ndarray:
  """Mean total-variation distance of every checkpoint's attention rows to the last one's."""
  final = attn_series[-1]
  return np.array([0.5 * np.abs(a - final).sum(-1).mean() for a in attn_series])


def checkpoint_precision(params, fwd, it: dict, hb: dict, db: dict) -> dict:
  """What the precision side of the frame-precision probe reads at one checkpoint, on one
  validation batch: |corr(PC1 of last-layer values, entropy)| (Paper III's manifold, no null)
  and the KL to the posterior in bits per supervised position."""
  import jax

  from mhc_jax import probes
  from mhc_jax.posterior import entropy_bits_pointwise

  mask = hb["mask"]
  bi, ti = np.nonzero(mask > 0)
  h = np.asarray(entropy_bits_pointwise(hb["posterior"]))[bi, ti]
  X = it["value"][-1].reshape(mask.shape + (-1,))[bi, ti]
  vm = probes.value_manifold(X, h, permutations=0)
  logits = np.asarray(jax.device_get(fwd(params, db)[0]), np.float64)
  q = np.exp(logits - logits.max(-1, keepdims=True))
  q /= q.sum(-1, keepdims=True)
  kl = kl_bits_dist(pad_vocab(hb["posterior"], q.shape[-1]), q)[bi, ti]
  return {"value_abs_corr": vm["abs_corr_pc1_entropy"], "kl_bits": float(kl.mean())}


def frame_precision_probe(attn_series: list[np.ndarray], prec: list[dict], steps) -> dict:
  from mhc_jax import probes

  fd = frame_dist(attn_series)
  corr = [p["value_abs_corr"] for p in prec]
  kl = [p["kl_bits"] for p in prec]
  by_corr = probes.frame_precision(steps, fd, corr)
  by_kl = probes.frame_precision(steps, fd, -np.log10(np.maximum(kl, 1e-6)))
  return {
    "definition": PAPER_DEFINITIONS["frame_precision"],
    "steps": list(steps),
    "frame_dist": fd,
    "value_abs_corr": corr,
    "kl_bits": kl,
    "frame_settled_step": by_corr["frame_settled_step"],
    "manifold_settled_step": by_corr["precision_settled_step"],
    "kl_settled_step": by_kl["precision_settled_step"],
    "frame_before_manifold": by_corr["frame_first"],
    "frame_before_kl": by_kl["frame_first"],
  }


# --------------------------------------------------------------------------------- driver


def evaluate_run(run_dir: str | os.PathLike, batches: int = 8) -> dict:
  """Evaluate a run directory's latest checkpoint; returns what eval.json holds."""
  import jax

  if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
    raise _usage(f"--batches must be a positive integer, got {batches!r}")
  t0 = time.perf_counter()
  run = storage.path(run_dir)
  cfg, source, mesh, model, abstract, ckpt, steps = load_run(run)
  try:
    params = restore_params(ckpt, abstract, steps[-1], run)
    fwd, inter = _forward_fns(model, cfg)
    pairs = _batches(source, cfg, batches, mesh)
    host_b, dev_b = [p[0] for p in pairs], [p[1] for p in pairs]
    logits, loss_sum, count = [], 0.0, 0.0
    for d in dev_b:
      lg, loss, n = fwd(params, d)
      loss, n = jax.device_get((loss, n))
      if source.has_posterior:
        logits.append(np.asarray(jax.device_get(lg)))
      loss_sum += float(loss) * float(n)
      count += float(n)
    eval_loss = loss_sum / max(count, 1.0)
    result: dict[str, Any] = {
      "run": str(run),
      "task": cfg.data.task,
      "step": steps[-1],
      "checkpoint_steps": steps,
      "batches": batches,
      "batch_size": cfg.data.batch_size,
      "seq_len": cfg.data.seq_len,
      "mixer": cfg.model.mixer,
      "target": cfg.data.target,
    }
    if not source.has_posterior:
      result["metrics"] = {
        "eval_loss": eval_loss,
        "bits_per_byte": eval_loss / math.log(2),
        "positions": int(count),
      }
    else:
      result["metrics"] = {"eval_loss": eval_loss, **fidelity(host_b, logits, source)}
      np_ = min(batches, PROBE_BATCHES)
      probes_out = geometry(cfg, source, params, inter, host_b[:np_], dev_b[:np_])
      why_not = drift_skip_reason(steps)
      attn_s, val_s, prec = [], [], []
      if len(steps) >= 3:
        for s in steps:
          p = params if s == steps[-1] else restore_params(ckpt, abstract, s, run)
          it = stacked_intermediates(inter(p, dev_b[0]["inputs"]), cfg.model.depth)
          attn_s.append(it["attn"])
          val_s.append(it["value"])
          prec.append(checkpoint_precision(p, fwd, it, host_b[0], dev_b[0]))
        probes_out["paper"]["frame_precision"] = frame_precision_probe(attn_s, prec, steps)
      else:
        probes_out["paper"]["frame_precision"] = {"skipped": "needs 3+ checkpoints"}
      if why_not is None:
        probes_out["drift"] = drift_probe(attn_s, val_s, steps)
      else:
        probes_out["drift"] = {"skipped": why_not, "controls": CONTROLS["drift"]}
      result["probes"] = probes_out
  finally:
    ckpt.close()
  result["wall_s"] = time.perf_counter() - t0
  return result


def _plain(o: Any) -> Any:
  if isinstance(o, dict):
    return {str(k): _plain(v) for k, v in o.items()}
  if isinstance(o, (list, tuple)):
    return [_plain(v) for v in o]
  if isinstance(o, (np.ndarray, np.generic)) or hasattr(o, "__array__"):
    a = np.asarray(o)
    return a.item() if a.ndim == 0 else a.tolist()
  return o


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
  """``obj`` as JSON through the package's one atomic writer (numpy keys and values made plain;
  non-finite floats, empty groups of a curve, written as NaN as in metrics.jsonl)."""
  storage.write_json_atomic(path, _plain(obj))


def summary_lines(r: dict) -> list[str]:
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
    f"  accuracy {m['accuracy']:.3f}  ECE {m['ece']:.3f}  eval loss "
    f"{m['eval_loss']:.4f}"
  )
  base = m.get("baselines") or {"uniform": {"kl_bits": m["kl_bits_uniform"]}}
  lines.append(
    "  baselines, KL bits/position: "
    + ", ".join(f"{name.replace('_', '-')} {b['kl_bits']:.4f}" for name, b in base.items())
  )
  f = m.get("filtering")
  if f:
    verdict = "reached" if f["reached"] else "NOT reached"
    lines.append(
      f"  filtering (KL <= header-only/10 = {f['threshold_bits']:.4f}): {verdict}; "
      f"KL is {f['kl_over_header_only']:.3f} x header-only; "
      f"{'beats' if f['beats_last_obs'] else 'does NOT beat'} the last-observation "
      "guess"
    )
  p = r.get("probes", {})
  bits = []
  ko = p.get("key_orthogonality", {})
  if "mean_abs_cos" in ko:
    rh = ko.get("retrieval_head")
    bits.append(
      f"keys (pre-RoPE) mean |cos| {ko['mean_abs_cos']:.3f} = "
      f"{ko['ratio_to_random']:.2f} x random"
      + (
        f" (retrieval head {rh['mean_abs_cos']:.3f} = {rh['ratio_to_random']:.2f} x random)"
        if rh
        else ""
      )
    )
  qk = p.get("qk_alignment", {})
  if "slope" in qk:
    bits.append(
      f"retrieval head L{qk['layer']}H{qk['head']} attn on target "
      f"{qk['attn_on_target']:.2f}, pre-RoPE q-k cos slope {qk['slope']:+.4f}/evidence "
      "at fixed distance"
    )
  pc = p.get("pca_entropy", {})
  if "corr_pc1_entropy" in pc:
    bits.append(f"PC1 vs entropy, position partialled out: r = {pc['corr_pc1_entropy']:+.3f}")
  dr = p.get("drift", {})
  if "attention_settles_first" in dr:
    bits.append(
      f"attention settles first: {'yes' if dr['attention_settles_first'] else 'no'} "
      f"(fall {dr['attn_fall']:.2f} vs values {dr['value_fall']:.2f})"
    )
  if bits:
    lines.append("  " + "; ".join(bits))
  return lines


def main(args) -> int:
  run = storage.path(args.run)
  result = evaluate_run(run, getattr(args, "batches", 8))
  write_json_atomic(run / "eval.json", result)
  for line in summary_lines(result):
    print(line)
  print(f"wrote {run / 'eval.json'} ({result['wall_s']:.1f}s)")
  return 0
