"""The checkpoint series (``mhc-jax eval --run RUN --series``): one row of geometry per checkpoint,
each statistic beside its null (columns: docs/windtunnel_results.md, "The checkpoint series")."""

from __future__ import annotations

import math

import numpy as np

from mhc_jax.geometry import frame, probes, readout

M_Z = 3.0  # M: |r(PC1 of values, entropy)| among new keys within position >= null + 3 null s.d.


def _cols(name: str, r: dict | None, stat: str, null="null_mean", sd="null_std") -> dict:
  keys = {"": stat, "_null": null, "_null_sd": sd, "_z": "z"}
  return {name + k: float((r or {}).get(v, math.nan)) for k, v in keys.items()}


def _per_head(name: str, r: dict) -> dict:
  return {f"{name}_h{h}": float(c) for h, c in enumerate(r["mean_abs_cos_by_head"])}


def signatures(cfg, source, params, it: dict, hb: dict, entropy) -> dict:
  """The papers' signatures as columns, each with its null (``probes.paper``'s); the layer-0
  token keys also per head, and (bijection) those of the value tokens (``key_cos_val``)."""
  qk = (readout.qk_alignment_paper(cfg, source, it, hb).get("by_layer") or [{}])[-1]
  vm = readout.value_manifold_paper(cfg, source, it, hb, entropy)
  new, r = vm["controls"].get("new_keys_within_position"), "abs_corr_pc1_entropy"
  ko = readout.key_orthogonality_paper(cfg, source, params)
  keys = ("mean_abs_cos", "random_mean_abs_cos", "random_std")
  out = {
    **_cols("key_cos", ko["layer0"], *keys),
    **_per_head("key_cos", ko["layer0"]),
    **_cols("key_cos_centred", ko["layer0_centred"], *keys),
    **_cols("qk_slope", qk.get("slope"), "slope"),
    **_cols("qk_slope_wp", qk.get("slope_within_position"), "slope"),
    **_cols("value_r", vm, r),
    **_cols("value_r_new_wp", new, r),
  }
  if cfg.data.task == "bijection":
    V = source.n_symbols
    ap = readout.attention_params(params, cfg.model.depth)
    val = probes.token_key_orthogonality(readout.token_keys(ap, np.arange(V, 2 * V))[0])
    out |= {**_cols("key_cos_val", val, *keys), **_per_head("key_cos_val", val)}
  out["M"] = bool(out["value_r_new_wp_z"] >= M_Z)
  return out


def formation(cfg, source, model, params, inputs, logits, posterior, mask, kl, kl_uniform) -> dict:
  """The formation statistics (:mod:`mhc_jax.geometry.frame`) on the run's own validation
  sequences: entropy MAE, the learned gate, the frame ratio and its null (bijection only)."""
  out = {"kl_bits_uniform": kl_uniform, "learned": frame.learned(kl, kl_uniform)}
  if cfg.data.task != "bijection":
    return out
  V = source.n_symbols
  hyp = np.arange(V, 2 * V)
  out |= frame.entropy_mae(logits, posterior, mask, hyp)
  tokens = np.asarray(inputs[: frame.FRAME_SEQUENCES])
  keys = np.nonzero(tokens[0] < V)[0]  # the key positions: the same in every sequence
  grams = frame.jacobian_grams(model, params, tokens, hyp, keys[0], keys[-1])
  ap = readout.attention_params(params, cfg.model.depth)
  norm = None if ap["norm"] is None else ap["norm"][0]
  fo = frame.frame_overlap(grams, keys, readout.rms_normed(ap["embedding"][hyp], norm))
  out |= {
    "frame_ratio": fo["ratio"],
    "frame_overlap": fo["overlap"],
    "frame_null": fo["null_mean"],
    "frame_null_sd": fo["null_std"],
    **{f"frame_ratio_{n}": float(x) for n, x in zip(("emb", "block0"), fo["ratio_by_layer"])},
  }
  return out
