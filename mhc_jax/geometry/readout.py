"""Geometry read from a model: its intermediates and attention weights, turned into the
project's probes and the wind-tunnel papers' own definitions (:mod:`mhc_jax.geometry.probes` does
the arithmetic). Each probe comes with its null and the confound it controls for;
docs/windtunnel_results.md ("The probes and their controls", "What eval.json holds") says which.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from mhc_jax import posterior as P
from mhc_jax.geometry import probes

PROBE_BATCHES = 2  # validation batches the geometry probes use
PCA_MAX_POINTS = 4096
PAPER_PERMUTATIONS = 1000  # permutation draws of each shuffled-label null
PAPER_FIGURE_POINTS = 1500  # value-PCA points stored in eval.json for the figures

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


def stacked_intermediates(inter: dict, depth: int) -> dict[str, np.ndarray]:
  """Model intermediates with a leading layer axis: ``stream``, ``q``/``k`` (after RoPE),
  ``q_pre``/``k_pre`` (before RoPE, where sown), ``value``, ``attn`` (numpy)."""

  def unpack(tree):
    a = tree["attn"]
    out = {"stream": tree["stream"][0], "q": a["q"][0], "k": a["k"][0], "attn": a["attn"][0]}
    out |= {"q_pre": a.get("q_pre_rope", a["q"])[0], "k_pre": a.get("k_pre_rope", a["k"])[0]}
    return out | {"value": a["value"]["__call__"][0]}

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
  q, k = it["q_pre"][layer][bi, ti, head], it["k_pre"][layer][bi, si, head]
  r = probes.qk_alignment_by_evidence(q, k, ev, num_groups=G, distance=ti - si)
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
  }


def pca_probe(stream: np.ndarray, positions, entropy, seed: int = 0) -> dict:
  """PCA of the residual stream at ``positions`` vs the entropy, position partialled out."""
  bi, ti = positions
  if len(bi) > PCA_MAX_POINTS:
    sel = np.sort(np.random.default_rng(seed).choice(len(bi), PCA_MAX_POINTS, replace=False))
    bi, ti = bi[sel], ti[sel]
  h = entropy[bi, ti]
  if len(bi) < 3 or np.std(probes.partial_out(h, strata=ti)) < 1e-9:
    return {
      "skipped": "the posterior entropy does not vary within a position on the probe positions"
    }
  per_layer = [probes.pca_vs_entropy(s[bi, ti].sum(axis=-2), h, k=3, strata=ti) for s in stream]
  last = per_layer[-1]
  return {
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
    out["pca_entropy"] = pca_probe(it["stream"], new_keys, entropy)
    out["pca_entropy"]["positions"] = "new keys (not seen before in the sequence)"
  else:  # hmm
    opos = np.nonzero(
      (inputs < source.n_symbols) & (np.arange(inputs.shape[1])[None, :] >= source.header_len)
    )
    out["key_orthogonality"] = key_orthogonality_probe(
      it["k_pre"], opos, inputs[opos], "observed symbol"
    )
    out["qk_alignment"] = {"skipped": "HMM filtering has no single target position to retrieve"}
    out["pca_entropy"] = pca_probe(it["stream"], sup, entropy)
    out["pca_entropy"]["positions"] = "all supervised positions"
  out["paper"] = {
    "key_orthogonality": key_orthogonality_paper(cfg, source, params),
    "qk_alignment": qk_alignment_paper(cfg, source, it, hb),
    "value_manifold": value_manifold_paper(cfg, source, it, hb, entropy),
  }
  return out


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


def rms_normed(x: np.ndarray, scale) -> np.ndarray:
  y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)
  return y if scale is None else y * scale


def token_keys(ap: dict, tokens) -> np.ndarray:
  """The key ``[L, V, H, D]`` each token gets from its embedding alone at each layer."""
  e = ap["embedding"][np.asarray(tokens)]
  out = []
  for l in range(ap["key"].shape[0]):
    x = e if ap["norm"] is None else rms_normed(e, ap["norm"][l])
    k = np.einsum("vc,chd->vhd", x, ap["key"][l])
    out.append(k if ap["k_norm"] is None else rms_normed(k, ap["k_norm"][l]))
  return np.stack(out)


def key_orthogonality_paper(cfg, source, params) -> dict:
  """Paper I's token keys per layer and Paper III's W_K columns, against random directions
  (HMM: the observation symbols and levels; hidden states have no token of their own)."""
  ap = attention_params(params, cfg.model.depth)
  bij = cfg.data.task == "bijection"
  what = "the key symbols" if bij else "observation symbols and levels"
  n = source.n_symbols if bij else source.level_offset + source.n_levels
  keys = token_keys(ap, np.arange(n))
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
    drop = ("projections", "components", "corr_entropy")
    return {k: r[k] for k in r if k not in drop}, r["projections"][:, :2]

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


def checkpoint_probes(depth: int, params, logits_fn, inter, restore, steps, hb, db) -> dict:
  """``frame_precision`` over the kept checkpoints (3+): does attention settle before the value
  manifold's |r(PC1, entropy)| and the KL? ``logits_fn(params, batch)`` and ``inter(params,
  tokens)`` read the model, ``restore(step)`` the checkpoints before the last (``params``)."""
  if len(steps) < 3:
    return {"skipped": "needs 3+ checkpoints"}
  mask, post = hb["mask"], hb["posterior"]
  bi, ti = np.nonzero(mask > 0)
  h = np.asarray(P.entropy_bits_pointwise(post))[bi, ti]
  attn, corr, kl = [], [], []
  for s in steps:
    p = params if s == steps[-1] else restore(s)
    it = stacked_intermediates(inter(p, db["inputs"]), depth)
    attn.append(it["attn"])
    logits = logits_fn(p, db)
    X = it["value"][-1].reshape(mask.shape + (-1,))[bi, ti]
    corr.append(probes.value_manifold(X, h, permutations=0)["abs_corr_pc1_entropy"])
    padded = np.pad(post, [(0, 0), (0, 0), (0, logits.shape[-1] - post.shape[-1])])
    kl.append(float(np.asarray(P.kl_bits_pointwise(padded, logits))[bi, ti].mean()))
  fd = np.array([0.5 * np.abs(a - attn[-1]).sum(-1).mean() for a in attn])
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
