"""``mhc-jax eval --run DIR [--batches N]``: posterior fidelity and geometry probes of a trained run.

Loads ``DIR/config.yaml`` and the latest orbax checkpoint in ``DIR/checkpoints``, evaluates it on
``N`` validation batches (the batches the trainer's in-loop eval starts with) and writes
``DIR/eval.json`` (atomically), with a short summary on stdout. docs/windtunnel_results.md ("What
eval.json holds") describes every field; ``--series``: every kept checkpoint instead, a row each
in ``DIR/geometry_series.csv`` (ibid., "The checkpoint series"). Bad input (no such directory, no
config.yaml, no checkpoint, a config that no longer validates, ``--batches < 1``): one ``error:``
line, exit 2.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mhc_jax import posterior as P, probes, storage
from mhc_jax.errors import ConfigError, UsageError
from mhc_jax.model import Transformer
from mhc_jax.train import checkpoint, sharding as sh
from mhc_jax.train.config import MeshConfig, load_config
from mhc_jax.train.loop import check_data, host_batch
from mhc_jax.train.optim import make_optimizer
from mhc_jax.train.state import abstract_state, state_shardings
from mhc_jax.train.step import token_loss

PROBE_BATCHES = 2  # validation batches the geometry probes use
PCA_MAX_POINTS = 4096
FILTERING_FACTOR = 10  # filtering counts only at KL <= header-only baseline / 10
PAPER_PERMUTATIONS = 1000  # permutation draws of each shuffled-label null
PAPER_FIGURE_POINTS = 1500  # value-PCA points stored in eval.json for the figures
SERIES_CSV = "geometry_series.csv"  # `mhc-jax eval --series`: one row per checkpoint

# what each probe controls for, written into eval.json (docs/windtunnel_results.md says why)
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


# --------------------------------------------------------------------------------- loading


def _open_run(run: Path):
  """(cfg, source, mesh, model, abstract state, Checkpoints, checkpoint steps) of a run dir."""
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
  return cfg, source, mesh, model, abstract, ckpt, steps


def _restore_params(ckpt, abstract, step: int, run: Path):
  try:
    state, _ = ckpt.restore(abstract, step)
  except Exception as e:  # orbax raises many kinds; the first line says what went wrong
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    raise UsageError(
      f"--run: cannot restore checkpoint {step} of {run} ({type(e).__name__}: {first})"
    ) from None
  return state.params


def _forward_fns(model, cfg):
  """Jitted (logits, loss, count) of a batch, and the model's sown intermediates."""

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


# --------------------------------------------------------------------------------- metrics


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
  cat = {
    k: np.concatenate([b[k] for b in host_batches])
    for k in ("posterior", "mask", "evidence", "inputs")
  }
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


# --------------------------------------------------------------------------------- probes


def stacked_intermediates(inter: dict, depth: int) -> dict[str, np.ndarray]:
  """Model intermediates with a leading layer axis: ``stream``, ``q``/``k`` (after RoPE),
  ``q_pre``/``k_pre`` (before RoPE, where sown), ``value``, ``attn`` (numpy)."""

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


def previous_occurrence(inputs: np.ndarray, seen: np.ndarray, ask=None) -> np.ndarray:
  """``[B,T]``: for positions in ``ask`` (default ``seen``), the latest earlier position in
  ``seen`` holding the same token, else -1."""
  ask = seen if ask is None else ask
  prev = np.full(inputs.shape, -1, np.int64)
  for b in range(inputs.shape[0]):
    last: dict[int, int] = {}
    for t in np.nonzero(seen[b])[0]:
      tok = int(inputs[b, t])
      if ask[b, t] and tok in last:
        prev[b, t] = last[tok]
      last[tok] = t
  return prev


def _by_layer(per_layer: list[dict], *keys: str) -> dict:
  return {f"{k}_by_layer": [r[k] for r in per_layer] for k in keys}


def key_orthogonality_probe(k: np.ndarray, positions, hyp, grouping: str, head=None) -> dict:
  """Keys ``[L,B,T,H,D]`` at ``positions`` grouped by ``hyp``, per layer and for ``head``."""
  bi, ti = positions
  if len(np.unique(hyp)) < 2:
    return {"grouping": grouping, "skipped": "fewer than two hypotheses in the probe batches"}
  flat = [k[l][bi, ti].reshape(len(bi), -1) for l in range(k.shape[0])]
  per_layer = [probes.key_orthogonality(x, hyp, center=True) for x in flat]
  last = per_layer[-1]
  summary = ("mean_abs_cos", "max_abs_cos", "within_cos", "random_mean_abs_cos", "ratio_to_random")
  out = {
    "grouping": grouping,
    "reads": "keys before RoPE",
    "controls": CONTROLS["key_orthogonality"],
    "layer": k.shape[0] - 1,
    "hypotheses": int(len(last["hypotheses"])),
    "points": int(len(bi)),
    **{s: last[s] for s in summary},
    **_by_layer(per_layer, "mean_abs_cos", "random_mean_abs_cos", "ratio_to_random", "within_cos"),
  }
  if head is not None:
    l, h = head
    r = probes.key_orthogonality(k[l][bi, ti, h], hyp, center=True)
    out["retrieval_head"] = {"layer": int(l), "head": int(h), **{s: r[s] for s in summary}}
  return out


def qk_alignment_probe(it: dict, tgt: np.ndarray, evidence: np.ndarray, G: int) -> dict:
  """The retrieval head (most attention on targets) and its pre-RoPE q-k cosine by evidence."""
  bi, ti = np.nonzero(tgt >= 0)
  if len(bi) < 2:
    return {"skipped": "no query whose key was seen before (bijection with replacement=false?)"}
  si = tgt[bi, ti]
  on_target = np.moveaxis(it["attn"][:, bi, :, ti, si], 0, -1)  # [L,B,H,T,S] -> [L, H, N]
  mean_on = on_target.mean(-1)
  layer, head = np.unravel_index(int(np.argmax(mean_on)), mean_on.shape)
  ev = evidence[bi, ti]

  def align(q, k, **kw):
    return probes.qk_alignment_by_evidence(
      it[q][layer][bi, ti, head], it[k][layer][bi, si, head], ev, num_groups=G, **kw
    )

  r = align("q_pre", "k_pre", distance=ti - si)
  a = on_target[layer, head]
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
    "attn_on_target_by_evidence": probes.mean_by_group(a, ev, G),
    "count_by_evidence": r["count"],
    "slope": r["slope"],
    "slope_unconditioned": r["slope_raw"],
    "distance_groups": r["distance_groups"],
    "slope_old_definition": align("q", "k")["slope_raw"],  # after RoPE, unconditioned
  }


def pca_probe(stream: np.ndarray, positions, entropy, seed: int = 0, old_positions=None) -> dict:
  """PCA of the residual stream at ``positions`` vs the entropy, position partialled out."""
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
  per_layer = [probes.pca_vs_entropy(s[bi, ti].sum(axis=-2), h, k=3, strata=ti) for s in stream]
  last = per_layer[-1]
  out = {
    "controls": CONTROLS["pca_entropy"],
    "layer": stream.shape[0] - 1,
    "points": int(len(bi)),
    "entropy_std_within_position": last["entropy_std"],
    **{k: last[k] for k in ("explained_variance_ratio", "corr_entropy", "corr_pc1_entropy")},
    "abs_corr_pc1_entropy": last["abs_corr_pc1_entropy"],
    **_by_layer(per_layer, "abs_corr_pc1_entropy"),
    "max_abs_corr_pc123_entropy_by_layer": [
      float(np.max(np.abs(r["corr_entropy"]))) for r in per_layer
    ],
    "pc1_variance_by_layer": [float(r["explained_variance_ratio"][0]) for r in per_layer],
  }
  if old_positions is not None:
    ob, ot = subsample(*old_positions)
    if np.std(entropy[ob, ot]) > 0:
      old = probes.pca_vs_entropy(stream[-1][ob, ot].sum(axis=-2), entropy[ob, ot], k=3)
      out["abs_corr_pc1_entropy_old_definition"] = old["abs_corr_pc1_entropy"]
  return out


def drift_probe(series_attn: list[np.ndarray], series_value: list[np.ndarray], steps) -> dict:
  """Attention vs value drift over the checkpoints (``probes.drift``), overall and per layer."""
  r = probes.drift(np.stack(series_attn), np.stack(series_value), steps)
  per_layer = [
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
    **{k: r[k] for k in ("attn_fall", "value_fall", "attention_settles_first")},
    **_by_layer(per_layer, "attn_drift", "value_drift", "attention_settles_first"),
    "attn_drift_relative_old_definition": r["attn_drift_relative"],
    "value_drift_relative_old_definition": r["value_drift_relative"],
  }


def drift_skip_reason(steps) -> str | None:
  """Why the drift probe cannot run on these checkpoint steps (None: it can)."""
  n = probes.MIN_DRIFT_CHECKPOINTS
  if len(steps) < n:
    return (
      f"needs {n}+ checkpoints spread through training, the run kept "
      f"{len(steps)} (set train.ckpt_every and train.keep_ckpts >= {n})"
    )
  if steps[0] > steps[-1] / 2:
    return (
      f"the kept checkpoints {list(steps)} cover only the end of training; the first must "
      f"be no later than half-way (raise train.ckpt_every)"
    )
  return None


def probe_arrays(cfg, params, inter_fn, host_batches, dev_batches):
  """(intermediates, host batch, posterior entropy) over the probe batches, batches joined."""
  parts = [
    stacked_intermediates(inter_fn(params, d["inputs"]), cfg.model.depth) for d in dev_batches
  ]
  it = {k: np.concatenate([p[k] for p in parts], axis=1) for k in parts[0]}
  hb = {k: np.concatenate([b[k] for b in host_batches]) for k in host_batches[0]}
  return it, hb, np.asarray(P.entropy_bits_pointwise(hb["posterior"])) * hb["mask"]


def geometry(cfg, source, params, inter_fn, host_batches, dev_batches) -> dict:
  """The project's probes and the papers' definitions on the probe batches."""
  it, hb, entropy = probe_arrays(cfg, params, inter_fn, host_batches, dev_batches)
  mask, inputs, evidence = hb["mask"], hb["inputs"], hb["evidence"].astype(np.int64)
  sup = np.nonzero(mask > 0)
  out: dict[str, Any] = {"batches": len(host_batches), "controls": CONTROLS}
  if cfg.data.task == "bijection":
    V = source.n_symbols
    vpos = np.nonzero((inputs >= V) & (inputs < 2 * V))
    vpos = (vpos[0][vpos[1] > 0], vpos[1][vpos[1] > 0])
    prev = previous_occurrence(inputs, mask > 0)
    tgt = np.where(prev >= 0, prev + 1, -1)  # the value after the key's latest occurrence
    qk = qk_alignment_probe(it, tgt, evidence, int(evidence.max()) + 1)
    out["key_orthogonality"] = key_orthogonality_probe(
      it["k_pre"],
      vpos,
      inputs[vpos[0], vpos[1] - 1],
      "key symbol answered by the value token",
      (qk["layer"], qk["head"]) if "layer" in qk else None,
    )
    out["qk_alignment"] = qk
    new_keys = np.nonzero((mask > 0) & (tgt < 0))
    out["pca_entropy"] = pca_probe(it["stream"], new_keys, entropy, old_positions=sup)
    out["pca_entropy"]["positions"] = "new keys (not seen before in the sequence)"
  else:  # hmm
    opos = np.nonzero(
      (inputs < source.n_symbols) & (np.arange(inputs.shape[1])[None, :] >= source.header_len)
    )
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


def attention_params(params, depth: int) -> dict:
  """``embedding [V, C]``, and per layer the key kernels ``key [L, C, H, D]``, pre-attention
  RMSNorm scales ``norm [L, C]`` and qk-norm scales ``k_norm [L, D]`` (None where absent)."""
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
  """The key ``[L, V, H, D]`` each token gets from its embedding alone at each layer."""
  e = ap["embedding"][np.asarray(tokens)]
  out = []
  for l in range(ap["key"].shape[0]):
    x = e if ap["norm"] is None else _rms_normed(e, ap["norm"][l])
    k = np.einsum("vc,chd->vhd", x, ap["key"][l])
    out.append(k if ap["k_norm"] is None else _rms_normed(k, ap["k_norm"][l]))
  return np.stack(out)


def key_orthogonality_paper(cfg, source, params) -> dict:
  """Paper I's token keys per layer and Paper III's W_K columns, against random directions
  (HMM: the observation symbols and levels; hidden states have no token of their own)."""
  ap = attention_params(params, cfg.model.depth)
  if cfg.data.task == "bijection":
    toks, what = np.arange(source.n_symbols), "the key symbols"
  else:
    toks = np.arange(source.level_offset + source.n_levels)
    what = "observation symbols and levels"
  keys = token_keys(ap, toks)
  tok = [probes.token_key_orthogonality(k) for k in keys]
  centred = probes.token_key_orthogonality(keys[0], center=True)
  wk = [probes.weight_key_orthogonality(w) for w in ap["key"]]
  return {
    "definition": PAPER_DEFINITIONS["token_key_orthogonality"],
    "tokens": what,
    "layer0": {k: tok[0][k] for k in tok[0] if k != "cos"},
    "layer0_centred": {k: v for k, v in centred.items() if k != "cos"},
    "cos_layer0": tok[0]["cos"],
    "random_mean_abs_cos": tok[0]["random_mean_abs_cos"],
    **_by_layer(tok, "mean_abs_cos", "ratio_to_random", "z"),
    "weights": {
      "definition": PAPER_DEFINITIONS["weight_key_orthogonality"],
      "random_mean_abs_cos": wk[0]["random_mean_abs_cos"],
      **_by_layer(wk, "mean_abs_cos", "ratio_to_random"),
    },
  }


def query_key_positions(cfg, source, inputs: np.ndarray, mask: np.ndarray):
  """``[B, T]`` each: queries (supervised), key positions of the same kind (bijection: keys;
  HMM: observations), and each query's latest earlier position of its token (-1 if none)."""
  start = 1 if cfg.data.task == "bijection" else source.header_len
  kind = (inputs < source.n_symbols) & (np.arange(inputs.shape[1])[None] >= start)
  query = (mask > 0) & kind
  return query, kind, previous_occurrence(inputs, kind, ask=query)


def _slopes(rec: dict, name: str, values, e, pos, within: bool) -> None:
  """``rec[name]``: the slope against evidence vs permuted evidence; and within position."""
  rec[name] = probes.evidence_slope(values, e, permutations=PAPER_PERMUTATIONS)
  if within:
    rec[f"{name}_within_position"] = probes.evidence_slope(
      values, e, strata=pos, permutations=PAPER_PERMUTATIONS
    )


def qk_alignment_paper(cfg, source, it: dict, hb: dict) -> dict:
  """Paper I's q-k alignment per layer (PAPER_DEFINITIONS['qk_alignment'])."""
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
  m = earlier[qb, qt]  # [N, S]
  n = np.nonzero((prev[qb, qt] >= 0) & (m.sum(-1) >= 2))[0]  # queries whose symbol came before
  layers = []
  for l in range(it["q_pre"].shape[0]):
    q, k = probes._unit(it["q_pre"][l]), probes._unit(it["k_pre"][l])  # [B,T,H,D]
    c = (np.einsum("bthd,bshd->bts", q, k) / q.shape[2])[qb, qt]  # mean over heads: [N, S]
    mean = (c * m).sum(-1) / m.sum(-1)
    rec = {"mean": float(mean.mean()), "mean_by_evidence": probes.mean_by_group(mean, e, G)}
    _slopes(rec, "slope", mean, e, pos, within)
    if len(n) >= 3:
      matched = c[n, prev[qb[n], qt[n]]]
      contrast = matched - ((c[n] * m[n]).sum(-1) - matched) / (m[n].sum(-1) - 1)
      rec["contrast"] = float(contrast.mean())
      rec["contrast_by_evidence"] = probes.mean_by_group(contrast, e[n], G)
      _slopes(rec, "contrast_slope", contrast, e[n], pos[n], within)
    layers.append(rec)
  return {
    "definition": PAPER_DEFINITIONS["qk_alignment"],
    "queries": int(len(qb)),
    "evidence_varies_within_position": bool(within),
    "count_by_evidence": np.bincount(e, minlength=G),
    "by_layer": layers,
  }


def value_manifold_paper(cfg, source, it: dict, hb: dict, entropy, seed: int = 0) -> dict:
  """Paper III's value manifold on the last layer (PAPER_DEFINITIONS['value_manifold'])."""
  mask = hb["mask"]
  v = it["value"][-1].reshape(mask.shape + it["value"].shape[-2:])  # [B*T,H,D] -> [B,T,H,D]
  bi, ti = np.nonzero(mask > 0)
  X = v[bi, ti].reshape(len(bi), -1)
  h = entropy[bi, ti]

  def manifold(sel=slice(None), strata=None):
    r = probes.value_manifold(
      X[sel], h[sel], strata=strata, permutations=PAPER_PERMUTATIONS, seed=seed
    )
    return {k: r[k] for k in r if k != "projections"}, r["projections"]

  out, proj = manifold()
  rng = np.random.default_rng(seed)
  keep = np.sort(rng.choice(len(h), min(len(h), PAPER_FIGURE_POINTS), replace=False))
  out = {
    "definition": PAPER_DEFINITIONS["value_manifold"],
    "layer": int(it["value"].shape[0] - 1),
    **out,
    "figure": {"pc": proj[keep], "entropy": h[keep], "position": ti[keep]},
    "controls": {},
  }
  if np.std(probes.partial_out(h, strata=ti)) > 1e-9:
    out["controls"]["within_position"] = manifold(strata=ti)[0]
  if cfg.data.task == "bijection":
    _, _, prev = query_key_positions(cfg, source, hb["inputs"], mask)
    new = prev[bi, ti] < 0
    if new.sum() >= 3 and np.std(probes.partial_out(h[new], strata=ti[new])) > 1e-9:
      out["controls"]["new_keys_within_position"] = manifold(new, ti[new])[0]
  return out


def checkpoint_precision(params, fwd, it: dict, hb: dict, db: dict) -> dict:
  """|r(PC1 of last-layer values, entropy)| and KL at one checkpoint (frame-precision probe)."""
  mask = hb["mask"]
  bi, ti = np.nonzero(mask > 0)
  h = np.asarray(P.entropy_bits_pointwise(hb["posterior"]))[bi, ti]
  X = it["value"][-1].reshape(mask.shape + (-1,))[bi, ti]
  vm = probes.value_manifold(X, h, permutations=0)
  logits = np.asarray(jax.device_get(fwd(params, db)[0]), np.float64)
  q = np.exp(logits - logits.max(-1, keepdims=True))
  q /= q.sum(-1, keepdims=True)
  kl = kl_bits_dist(pad_vocab(hb["posterior"], q.shape[-1]), q)[bi, ti]
  return {"value_abs_corr": vm["abs_corr_pc1_entropy"], "kl_bits": float(kl.mean())}


def frame_precision_probe(attn_series: list[np.ndarray], prec: list[dict], steps) -> dict:
  """Does attention settle before the value manifold and the KL? (PAPER_DEFINITIONS)"""
  final = attn_series[-1]
  fd = np.array([0.5 * np.abs(a - final).sum(-1).mean() for a in attn_series])
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


def _checkpoint_probes(cfg, params, fwd, inter, restore, steps, hb, db) -> dict:
  """``frame_precision`` (3+ checkpoints) and ``drift`` over every kept checkpoint."""
  attn_s, val_s, prec = [], [], []
  out: dict[str, Any] = {"frame_precision": {"skipped": "needs 3+ checkpoints"}}
  if len(steps) >= 3:
    for s in steps:
      p = params if s == steps[-1] else restore(s)
      it = stacked_intermediates(inter(p, db["inputs"]), cfg.model.depth)
      attn_s.append(it["attn"])
      val_s.append(it["value"])
      prec.append(checkpoint_precision(p, fwd, it, hb, db))
    out["frame_precision"] = frame_precision_probe(attn_s, prec, steps)
  why_not = drift_skip_reason(steps)
  if why_not is None:
    out["drift"] = drift_probe(attn_s, val_s, steps)
  else:
    out["drift"] = {"skipped": why_not, "controls": CONTROLS["drift"]}
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
  if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
    raise UsageError(f"--batches must be a positive integer, got {batches!r}")
  t0 = time.perf_counter()
  run = storage.path(run_dir)
  cfg, source, mesh, model, abstract, ckpt, steps = _open_run(run)
  try:
    restore = lambda step: _restore_params(ckpt, abstract, step, run)
    params = restore(steps[-1])
    fwd, inter = _forward_fns(model, cfg)
    host_b, dev_b = _batches(source, cfg, mesh, batches)
    eval_loss, count, logits = _score(fwd, params, dev_b, source.has_posterior)
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
      k = min(batches, PROBE_BATCHES)
      probes_out = geometry(cfg, source, params, inter, host_b[:k], dev_b[:k])
      over = _checkpoint_probes(cfg, params, fwd, inter, restore, steps, host_b[0], dev_b[0])
      probes_out["paper"]["frame_precision"] = over["frame_precision"]
      probes_out["drift"] = over["drift"]
      result["probes"] = probes_out
  finally:
    ckpt.close()
  result["wall_s"] = time.perf_counter() - t0
  return result


def _cols(name: str, r: dict | None, stat: str, null="null_mean", sd="null_std") -> dict:
  keys = {"": stat, "_null": null, "_null_sd": sd, "_z": "z"}
  return {name + k: float((r or {}).get(v, math.nan)) for k, v in keys.items()}


def signatures(cfg, source, params, it: dict, hb: dict, entropy) -> dict:
  """The papers' signatures as columns, each with its null (``probes.paper``'s)."""
  qk = (qk_alignment_paper(cfg, source, it, hb).get("by_layer") or [{}])[-1]
  vm = value_manifold_paper(cfg, source, it, hb, entropy)
  new, r = vm["controls"].get("new_keys_within_position"), "abs_corr_pc1_entropy"
  ko = key_orthogonality_paper(cfg, source, params)
  keys = ("mean_abs_cos", "random_mean_abs_cos", "random_std")
  return {
    **_cols("key_cos", ko["layer0"], *keys),
    **_cols("key_cos_centred", ko["layer0_centred"], *keys),
    **_cols("qk_slope", qk.get("slope"), "slope"),
    **_cols("qk_slope_wp", qk.get("slope_within_position"), "slope"),
    **_cols("value_r", vm, r),
    **_cols("value_r_new_wp", new, r),
  }


def evaluate_series(run_dir: str | os.PathLike, batches: int = 8) -> list[dict]:
  """One row per kept checkpoint: eval loss, KL, ``signatures``, the attention's distance to the
  last checkpoint's (docs/windtunnel_results.md, "The checkpoint series")."""
  if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
    raise UsageError(f"--batches must be a positive integer, got {batches!r}")
  run = storage.path(run_dir)
  cfg, source, mesh, model, abstract, ckpt, steps = _open_run(run)
  rows, attn = [], []
  try:
    if not source.has_posterior:
      raise UsageError(f"--series: {run} is not a wind-tunnel run (no exact posterior)")
    fwd, inter = _forward_fns(model, cfg)
    host_b, dev_b = _batches(source, cfg, mesh, batches)
    # probes: bijection keys with replacement, every key supervised (whatever the run's layout)
    bij = cfg.data.task == "bijection"
    probe = dataclasses.replace(source, replacement=True, supervise="all") if bij else source
    probe_b = _batches(probe, cfg, mesh, PROBE_BATCHES)
    for s in steps:
      params = _restore_params(ckpt, abstract, s, run)
      loss, _, logits = _score(fwd, params, dev_b, True)
      it, hb, entropy = probe_arrays(cfg, params, inter, *probe_b)
      attn.append(it["attn"])
      kl = fidelity(host_b, logits, source)["kl_bits"]
      sig = signatures(cfg, probe, params, it, hb, entropy)
      rows.append({"step": s, "eval_loss": loss, "kl_bits": kl, **sig})
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
  pc, dr = p.get("pca_entropy", {}), p.get("drift", {})
  bits = []
  if "mean_abs_cos" in ko:
    x = "{mean_abs_cos:.3f} = {ratio_to_random:.2f} x random"
    rh = ko.get("retrieval_head")
    bits.append(
      "keys (pre-RoPE) mean |cos| "
      + x.format(**ko)
      + (f" (retrieval head {x.format(**rh)})" if rh else "")
    )
  if "slope" in qk:
    bits.append(
      f"retrieval head L{qk['layer']}H{qk['head']} attn on target {qk['attn_on_target']:.2f}, "
      f"pre-RoPE q-k cos slope {qk['slope']:+.4f}/evidence at fixed distance"
    )
  if "corr_pc1_entropy" in pc:
    bits.append(f"PC1 vs entropy, position partialled out: r = {pc['corr_pc1_entropy']:+.3f}")
  if "attention_settles_first" in dr:
    bits.append(
      f"attention settles first: {'yes' if dr['attention_settles_first'] else 'no'} "
      f"(fall {dr['attn_fall']:.2f} vs values {dr['value_fall']:.2f})"
    )
  return lines + (["  " + "; ".join(bits)] if bits else [])


def main(args) -> int:
  run = storage.path(args.run)
  if getattr(args, "series", False):
    import pandas as pd

    rows = evaluate_series(run, args.batches)
    storage.write_text_atomic(run / SERIES_CSV, pd.DataFrame(rows).to_csv(index=False))
    cols = ["step", "kl_bits", "key_cos", "key_cos_null", "value_r_new_wp", "value_r_new_wp_null"]
    print(pd.DataFrame(rows)[cols + ["frame_dist"]].to_string(index=False, float_format="%.4f"))
    print(f"wrote {run / SERIES_CSV} ({len(rows)} checkpoints)")
    return 0
  result = evaluate_run(run, getattr(args, "batches", 8))
  storage.write_json_atomic(run / "eval.json", result)
  print("\n".join(summary_lines(result)))
  print(f"wrote {run / 'eval.json'} ({result['wall_s']:.1f}s)")
  return 0
