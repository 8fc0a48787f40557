"""Geometry probes: pure numpy functions over arrays a caller extracts from a trained model.

They measure the geometry the wind-tunnel papers report (key orthogonality, query-key alignment
against evidence, a value / residual manifold tracking the entropy, attention settling first),
each against a null and with the confound that would fake the effect controlled for;
docs/windtunnel_results.md ("The probes and their controls") says which and why. Inputs may be
numpy or jax arrays; outputs are numpy arrays and Python floats.
"""

from __future__ import annotations

import numpy as np


def _unit(x: np.ndarray, axis: int = -1, eps: float = 1e-12) -> np.ndarray:
  x = np.asarray(x, np.float64)
  return x / np.maximum(np.linalg.norm(x, axis=axis, keepdims=True), eps)


def mean_by_group(values, groups, num_groups: int) -> np.ndarray:
  """Mean of `values [N]` for each integer group id in [0, num_groups); NaN where empty."""
  g = np.asarray(groups).reshape(-1)
  count = np.bincount(g, minlength=num_groups).astype(np.float64)
  total = np.bincount(g, weights=np.asarray(values).reshape(-1), minlength=num_groups)
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(count > 0, total / count, np.nan)


def partial_out(y, strata=None) -> np.ndarray:
  """Residuals of `y [N]` or `[N, D]` after removing stratum means (fixed effects); without
  strata, `y` is only centred."""
  y = np.asarray(y, np.float64)
  if strata is None:
    return y - y.mean(axis=0, keepdims=True)
  _, inv = np.unique(np.asarray(strata), return_inverse=True)
  inv = inv.reshape(-1)
  a2 = y.reshape(len(y), -1)
  sums = np.zeros((inv.max() + 1, a2.shape[1]))
  np.add.at(sums, inv, a2)
  return (a2 - (sums / np.bincount(inv)[:, None])[inv]).reshape(y.shape)


def _slope(x_res: np.ndarray, y_res: np.ndarray, empty: float = 0.0) -> float:
  """Least-squares slope of y on x from their residuals; `empty` when x does not vary."""
  den = float((x_res * x_res).sum())
  return float((x_res * y_res).sum() / den) if den > 1e-12 else empty


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
  a, b = a - a.mean(), b - b.mean()
  den = np.sqrt((a * a).sum() * (b * b).sum())
  return float((a * b).sum() / den) if den > 1e-12 else 0.0


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
  rank = lambda x: np.argsort(np.argsort(x, kind="stable"), kind="stable").astype(np.float64)
  return _pearson(rank(a), rank(b))


def _pca(X, strata=None, standardise: bool = False):
  """(data residualised on strata and, when `standardise`, scaled to unit variance per
  coordinate (constant ones dropped), explained variance ratios, components)."""
  A = partial_out(X, strata)
  if standardise:
    sd = A.std(axis=0)
    A = A[:, sd > 1e-12] / sd[sd > 1e-12]
  _, s, vt = np.linalg.svd(A, full_matrices=False)
  return A, s**2 / max(float((s**2).sum()), 1e-300), vt


def offdiag_abs_cos(x) -> float:
  """Mean |cos| between the rows of `x [n, D]` over the n (n - 1) ordered off-diagonal pairs."""
  u = _unit(x)
  n = len(u)
  if n < 2:
    raise ValueError("offdiag_abs_cos needs at least two rows")
  return float(np.abs((u @ u.T)[~np.eye(n, dtype=bool)]).mean())


def random_abs_cos(n: int, dim: int, *, draws: int, seed: int = 0, center=False) -> np.ndarray:
  """`offdiag_abs_cos` of `n` isotropic random directions in `dim` dimensions (centred when
  `center`), for each of `draws` seeded draws: what a probe reads when there is no structure."""
  xs = np.random.default_rng(seed).standard_normal((draws, n, dim))
  return np.array([offdiag_abs_cos(x - x.mean(axis=0, keepdims=True) if center else x) for x in xs])


def key_orthogonality(keys, hypothesis_ids, *, center: bool = False) -> dict:
  """How orthogonal the mean key directions of different hypotheses are, against chance: keys
  [N, D], hypothesis_ids [N] int (centred first when `center`); docs/windtunnel_results.md."""
  keys = np.asarray(keys, np.float64)
  ids = np.asarray(hypothesis_ids)
  if keys.ndim != 2 or ids.shape != keys.shape[:1]:
    raise ValueError(f"need keys [N, D] and hypothesis_ids [N], got {keys.shape}, {ids.shape}")
  if center:
    keys = keys - keys.mean(axis=0, keepdims=True)
  hyps, inv = np.unique(ids, return_inverse=True)
  if len(hyps) < 2:
    raise ValueError("key_orthogonality needs at least two hypotheses")
  sums = np.zeros((len(hyps), keys.shape[1]))
  np.add.at(sums, inv, keys)
  dirs = _unit(sums)
  cos = dirs @ dirs.T
  off = ~np.eye(len(hyps), dtype=bool)
  within = np.sum(_unit(keys) * dirs[inv], axis=-1)
  mean_abs = float(np.abs(cos[off]).mean())
  rand = float(np.mean(random_abs_cos(len(hyps), keys.shape[1], draws=32, center=center)))
  return {
    "hypotheses": hyps,
    "cos": cos,
    "mean_abs_cos": mean_abs,
    "max_abs_cos": float(np.abs(cos[off]).max()),
    "within_cos": float(within.mean()),
    "random_mean_abs_cos": rand,
    "ratio_to_random": mean_abs / rand if rand > 0 else float("nan"),
  }


def qk_alignment_by_evidence(q, k, evidence, num_groups: int | None = None, distance=None) -> dict:
  """Cosine between each query `q [N, D]` and its target key `k [N, D]` against `evidence [N]`,
  the slope taken within groups of equal query-target `distance [N]` when given (fields:
  docs/windtunnel_results.md)."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  ev = np.asarray(evidence).astype(np.int64)
  if q.shape != k.shape or q.ndim != 2 or ev.shape != q.shape[:1]:
    raise ValueError(f"need q, k [N, D] and evidence [N], got {q.shape}, {k.shape}, {ev.shape}")
  cos = np.sum(_unit(q) * _unit(k), axis=-1)
  G = int(ev.max()) + 1 if num_groups is None else int(num_groups)
  keep = (ev >= 0) & (ev < G)
  e, c = ev[keep].astype(np.float64), cos[keep]
  align = mean_by_group(c, ev[keep], G)
  count = np.bincount(ev[keep], minlength=G).astype(np.float64)
  slope_raw = _slope(partial_out(e), partial_out(c))
  out = {"alignment": align, "count": count, "slope_raw": slope_raw, "cos": cos}
  if distance is None:
    out.update(slope=slope_raw, alignment_adjusted=align, distance_groups=0)
    return out
  dist = np.asarray(distance).astype(np.int64)
  if dist.shape != ev.shape:
    raise ValueError(f"need distance [N], got {dist.shape}")
  d = dist[keep]
  e_res = partial_out(e, strata=d)
  c_res = partial_out(c, strata=d)
  slope = _slope(e_res, c_res, empty=float("nan"))
  # the distance effect, fitted jointly with the evidence slope, is removed (demeaning the
  # cosine within distance alone would also remove the evidence effect collinear with distance)
  adj = c_res + (slope if np.isfinite(slope) else 0.0) * (e - e_res - e.mean()) + c.mean()
  _, cnt_d = np.unique(d, return_counts=True)
  out.update(
    slope=slope,
    alignment_adjusted=mean_by_group(adj, ev[keep], G),
    distance_groups=int((cnt_d > 1).sum()),
  )
  return out


def pca_vs_entropy(states, entropy, k: int = 3, strata=None) -> dict:
  """Leading principal components of `states [N, D]` and how they track `entropy [N]` (bits),
  both residualised on `strata` first (partial correlations): :func:`value_manifold` without
  standardising and without its null."""
  return value_manifold(states, entropy, k=k, strata=strata, permutations=0, standardise=False)


# ----------------------------------------------------------------- the papers' own definitions
# arXiv:2512.22471 (Paper I) and 2512.23752 (Paper III), as their released code computes them;
# docs/windtunnel_results.md says which file, and the null each comes with.


def _against_random(per_head: np.ndarray, null: np.ndarray) -> dict:
  mean = float(per_head.mean())
  return {
    "mean_abs_cos": mean,
    "mean_abs_cos_by_head": per_head,
    "random_mean_abs_cos": float(null.mean()),
    "random_std": float(null.std()),
    "ratio_to_random": mean / float(null.mean()),
  }


def token_key_orthogonality(keys, *, draws: int = 200, seed: int = 0, center=False) -> dict:
  """Paper I's key orthogonality: per head, mean |cos| between the keys `[V, H, D]` of the V
  hypothesis tokens' embeddings alone, uncentred, against V random directions in D dimensions.
  `center`: the keys less their mean over the V tokens, against centred random directions (a
  shared offset makes uncentred keys look aligned while their differences may be orthogonal).
  Fields: docs/windtunnel_results.md."""
  k = np.asarray(keys, np.float64)
  if k.ndim != 3 or k.shape[0] < 2:
    raise ValueError(f"need keys [V >= 2, H, D], got {k.shape}")
  V, H, D = k.shape
  k = k - k.mean(axis=0, keepdims=True) if center else k
  per_head = np.array([offdiag_abs_cos(k[:, h]) for h in range(H)])
  off = ~np.eye(V, dtype=bool)
  signed = np.array([float((_unit(k[:, h]) @ _unit(k[:, h]).T)[off].mean()) for h in range(H)])
  null = random_abs_cos(V, D, draws=draws, seed=seed, center=center)
  out = _against_random(per_head, null)
  flat = _unit(k.reshape(V, H * D))
  cos = flat @ flat.T
  sd_mean = float(null.std()) / np.sqrt(H)
  return {
    **out,
    "mean_signed_cos_by_head": signed,
    "z": (out["mean_abs_cos"] - float(null.mean())) / sd_mean if sd_mean > 0 else float("nan"),
    "cos": cos,
    "concat_mean_abs_cos": float(np.abs(cos[off]).mean()),
    "concat_random_mean_abs_cos": float(random_abs_cos(V, H * D, draws=16, seed=seed + 1).mean()),
  }


def weight_key_orthogonality(kernel, *, draws: int = 200, seed: int = 0) -> dict:
  """Paper III's key orthogonality (Sec. 4.2): per head, mean |cos| between the D columns of
  W_K `[C, H, D]`, against D random directions in C dimensions."""
  w = np.asarray(kernel, np.float64)
  if w.ndim != 3 or w.shape[2] < 2:
    raise ValueError(f"need a key kernel [C, H, D >= 2], got {w.shape}")
  C, H, D = w.shape
  per_head = np.array([offdiag_abs_cos(w[:, h, :].T) for h in range(H)])
  return _against_random(per_head, random_abs_cos(D, C, draws=draws, seed=seed))


def _strata_perm(rng, x: np.ndarray, strata) -> np.ndarray:
  if strata is None:
    return rng.permutation(x)
  out = x.copy()
  for s in np.unique(strata):
    idx = np.nonzero(strata == s)[0]
    out[idx] = x[rng.permutation(idx)]
  return out


def _perm_null(x: np.ndarray, st, stat, n: int, seed: int) -> np.ndarray:
  """``stat`` of ``x`` permuted within strata ``st`` and partialled out, for ``n`` seeded draws."""
  rng = np.random.default_rng(seed)
  return np.array([stat(partial_out(_strata_perm(rng, x, st), strata=st)) for _ in range(n)])


def _null_summary(stat: float, null: np.ndarray) -> dict:
  sd = float(null.std())
  return {
    "null_mean": float(null.mean()),
    "null_std": sd,
    "z": (stat - float(null.mean())) / sd if sd > 0 else float("nan"),
    "p": float((1 + np.sum(np.abs(null) >= abs(stat))) / (1 + len(null))),
  }


def evidence_slope(
  values, evidence, *, strata=None, permutations: int = 1000, seed: int = 0
) -> dict:
  """Least-squares slope of `values [N]` on `evidence [N]` (within `strata` when given) against
  the slope with the evidence permuted (within strata). Returns `slope`, `points`,
  `null_mean`, `null_std`, `z`, `p` (two-sided)."""
  y = np.asarray(values, np.float64)
  e = np.asarray(evidence, np.float64)
  if y.ndim != 1 or e.shape != y.shape:
    raise ValueError(f"need values [N] and evidence [N], got {y.shape}, {e.shape}")
  st = None if strata is None else np.asarray(strata)
  y_res = partial_out(y, strata=st)
  s = _slope(partial_out(e, strata=st), y_res)
  null = _perm_null(e, st, lambda p: _slope(p, y_res), permutations, seed)
  return {"slope": s, "points": int(len(y)), **_null_summary(s, null)}


def value_manifold(
  values, entropy, *, k=3, strata=None, permutations=1000, seed=0, standardise=True
) -> dict:
  """Paper III's value manifold (Sec. 4.2): PCA of `values [N, D]` with every coordinate
  standardised (after demeaning within `strata`), and |r(PC1, entropy)| against the entropy
  permuted (within strata; `permutations=0`: no null keys). Fields: docs/windtunnel_results.md."""
  X = np.asarray(values, np.float64)
  h = np.asarray(entropy, np.float64)
  if X.ndim != 2 or h.shape != X.shape[:1] or len(h) < 3:
    raise ValueError(f"need values [N >= 3, D] and entropy [N], got {X.shape}, {h.shape}")
  st = None if strata is None else np.asarray(strata)
  Xs, evr, vt = _pca(X, strata=st, standardise=standardise)
  kk = int(min(k, len(evr)))
  proj = Xs @ vt[:kk].T
  hc = partial_out(h, strata=st)
  corr = np.array([_pearson(proj[:, i], hc) for i in range(kk)])
  r = float(corr[0])
  null = _perm_null(h, st, lambda p: abs(_pearson(proj[:, 0], p)), permutations, seed)
  nulls = _null_summary(abs(r), null) if permutations > 0 else {}
  noise = np.random.default_rng(seed + 1).standard_normal(X.shape)
  _, evr_rand, _ = _pca(noise, strata=st, standardise=standardise)
  return {
    "explained_variance_ratio": evr[:kk],
    "pc1_variance": float(evr[0]),
    "pc1_variance_random": float(evr_rand[0]),
    "components": vt[:kk],
    "projections": proj,
    "corr_entropy": corr,
    "entropy_std": float(hc.std()),
    "corr_pc1_entropy": r,
    "spearman_pc1_entropy": _spearman(proj[:, 0], hc),
    "abs_corr_pc1_entropy": abs(r),
    "points": int(len(h)),
    **nulls,
  }


def settle_step(steps, series, *, final=None, frac: float = 0.9) -> int:
  """The first checkpoint step from which `series` stays within (1 - frac) of its total change
  (first checkpoint -> `final`, default the last value) of `final`: where it has settled."""
  s = np.asarray(series, np.float64)
  st = np.asarray(steps)
  f = s[-1] if final is None else float(final)
  span = abs(s[0] - f)
  ok = np.abs(s - f) <= (1.0 - frac) * span + 1e-12
  bad = np.nonzero(~ok)[0]
  return int(st[0] if bad.size == 0 else st[min(bad[-1] + 1, len(st) - 1)])


def frame_precision(steps, frame_dist, precision, *, frac: float = 0.9) -> dict:
  """Paper I's frame-precision order: does `frame_dist [C]` (attention's distance to the final
  checkpoint) settle (`settle_step`) before `precision [C]` does? Returns `steps`,
  `frame_settled_step`, `precision_settled_step`, `frame_first`."""
  st = np.asarray(steps)
  f, p = np.asarray(frame_dist, np.float64), np.asarray(precision, np.float64)
  if st.ndim != 1 or len(st) < 3 or f.shape != st.shape or p.shape != st.shape:
    raise ValueError("frame_precision needs 3+ checkpoints and one value of each series per step")
  fs = settle_step(st, f, final=0.0, frac=frac)
  ps = settle_step(st, p, frac=frac)
  return {
    "steps": st,
    "frame_settled_step": fs,
    "precision_settled_step": ps,
    "frame_first": fs < ps,
  }
