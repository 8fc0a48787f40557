"""Geometry probes: pure numpy functions over arrays a caller extracts from a trained model.

They measure the geometry the wind-tunnel papers report for Bayesian in-context inference, each
with the confound that would make it report an effect that is not there controlled for:

- `key_orthogonality`: keys belonging to different hypotheses (e.g. different bijection keys)
  point in nearly orthogonal directions. Confound: a low |cos| means nothing without a scale
  (directions in D dimensions are nearly orthogonal by chance, ~sqrt(2 / (pi D))); every result
  carries the |cos| of as many random directions put through the same pipeline, and the ratio.
  Callers should read keys *before* RoPE: the rotation depends on the position, not the content.
- `qk_alignment_by_evidence`: the query at a position aligns more and more with the key it should
  retrieve as evidence accumulates. Confound: evidence grows with position, so with the distance
  between query and target; under RoPE (and in any position-dependent code) the cosine depends on
  that distance. The slope is taken within groups of equal distance (`distance=`), and callers
  read q and k before RoPE.
- `pca_vs_entropy`: residual states lie on a low-dimensional manifold whose leading coordinate
  tracks the posterior entropy. Confound: on bijection data most entropy variance is the binary
  "key seen before" flag, and among new keys entropy is almost a function of position; pass
  only positions of one kind (e.g. new keys) and `strata=` position, and states and entropy are
  both demeaned within each position before PCA and correlation (position partialled out).
- `drift`: across checkpoints, attention patterns settle before the values stop changing.
  Confounds: a norm that grows or shrinks during training reads as drift (or as settling), two
  checkpoints give one interval (no trend at all), and unevenly spaced checkpoints change the
  per-interval drift. It compares norm-free quantities (total-variation distance of attention
  rows, angle of value vectors) per training step, and needs at least 5 checkpoints.

Inputs may be numpy or jax arrays; outputs are numpy arrays and Python floats.
"""

from __future__ import annotations

import numpy as np

MIN_DRIFT_CHECKPOINTS = 5
SETTLE_MARGIN = 0.5  # attention "settles first" when its fall is below this times the values'


def _unit(x: np.ndarray, axis: int = -1, eps: float = 1e-12) -> np.ndarray:
  return x / np.maximum(np.linalg.norm(x, axis=axis, keepdims=True), eps)


def partial_out(y, strata=None, covariates=None) -> np.ndarray:
  """Residuals of `y [N]` or `[N, D]` after removing stratum means (fixed effects: any function
  of the stratum label, e.g. of the position) and then a linear fit on `covariates [N, c]`
  (with intercept; the covariates are residualised on the strata first, Frisch-Waugh).
  With neither, `y` is only centred."""
  y = np.asarray(y, np.float64)
  if strata is None:
    r = y - y.mean(axis=0, keepdims=True)
    cov = None if covariates is None else np.asarray(covariates, np.float64)
    if cov is not None:
      cov = cov.reshape(len(cov), -1)
      cov = cov - cov.mean(axis=0, keepdims=True)
  else:
    _, inv = np.unique(np.asarray(strata), return_inverse=True)
    inv = inv.reshape(-1)

    def demean(a):
      a2 = a.reshape(len(a), -1)
      sums = np.zeros((inv.max() + 1, a2.shape[1]))
      np.add.at(sums, inv, a2)
      cnt = np.bincount(inv).astype(np.float64)[:, None]
      return (a2 - (sums / cnt)[inv]).reshape(a.shape)

    r = demean(y)
    cov = (
      None if covariates is None else demean(np.asarray(covariates, np.float64).reshape(len(y), -1))
    )
  if cov is not None and cov.size:
    coef, *_ = np.linalg.lstsq(cov, r.reshape(len(r), -1), rcond=None)
    r = r - (cov @ coef).reshape(r.shape)
  return r


def random_direction_abs_cos(
  n: int, dim: int, *, center: bool = False, draws: int = 32, seed: int = 0
) -> float:
  """Mean |cos| between `n` isotropic random directions in `dim` dimensions, put through the
  same centring as `key_orthogonality` (averaged over `draws` seeded draws): the value an
  orthogonality probe gives when the directions carry no structure."""
  rng = np.random.default_rng(seed)
  off = ~np.eye(n, dtype=bool)
  vals = []
  for _ in range(draws):
    x = rng.standard_normal((n, dim))
    if center:
      x = x - x.mean(axis=0, keepdims=True)
    u = _unit(x)
    vals.append(np.abs((u @ u.T)[off]).mean())
  return float(np.mean(vals))


def key_orthogonality(keys, hypothesis_ids, *, center: bool = False) -> dict:
  """How orthogonal the mean key directions of different hypotheses are, against chance.

  keys [N, D], hypothesis_ids [N] int. The keys of each hypothesis are averaged (after
  subtracting the global mean when `center`), normalised, and compared by cosine.
  Returns `cos [H, H]` (hypotheses in sorted id order, `hypotheses [H]`), `mean_abs_cos` and
  `max_abs_cos` over off-diagonal pairs (0 = orthogonal), `within_cos`, the mean cosine of
  individual keys to their own hypothesis direction (1 = consistent), and the reference:
  `random_mean_abs_cos` (H random directions in D dimensions, centred alike) and
  `ratio_to_random` = mean_abs_cos / random_mean_abs_cos (about 1: no more orthogonal than
  chance; well below 1: orthogonal beyond chance).

  Controls for: reading a small |cos| as orthogonality when random directions in that
  dimension would score as low (old definition: `mean_abs_cos` alone).
  """
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
  rand = random_direction_abs_cos(len(hyps), keys.shape[1], center=center)
  return {
    "hypotheses": hyps,
    "cos": cos,
    "mean_abs_cos": mean_abs,
    "max_abs_cos": float(np.abs(cos[off]).max()),
    "within_cos": float(within.mean()),
    "random_mean_abs_cos": rand,
    "ratio_to_random": mean_abs / rand if rand > 0 else float("nan"),
  }


def _slope(x: np.ndarray, y: np.ndarray) -> float:
  """Least-squares slope of y on x (both already centred or residualised)."""
  x = x - x.mean()
  den = float((x * x).sum())
  return float((x * (y - y.mean())).sum() / den) if den > 0 else 0.0


def qk_alignment_by_evidence(q, k, evidence, num_groups: int | None = None, distance=None) -> dict:
  """Cosine between each query and the key it should attend to, against evidence.

  q [N, D] queries, k [N, D] the matching (target) keys, evidence [N] int (e.g. number of
  distinct values revealed), distance [N] int (query position minus target position; optional).
  Returns `cos [N]`, `alignment [G]` (mean cosine per evidence value, NaN where empty),
  `count [G]`, `slope_raw` (least-squares slope of cosine on evidence, the old definition), and
  `slope`: the slope within groups of equal distance (both demeaned per distance, i.e. distance
  as fixed effects; equals `slope_raw` without `distance`). > 0 = sharpening with evidence.
  `alignment_adjusted [G]`: per-evidence means of the cosine with the distance effect removed
  (distance fixed effects fitted jointly with the evidence slope; plus the overall mean). `distance_groups`: how many distances held 2+ points.

  Controls for: evidence growing with the query-target distance, which alone moves the
  cosine when q and k carry position (RoPE, or a learned drift with position). Read q and k
  before RoPE as well: the rotation is a function of the distance.
  """
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  ev = np.asarray(evidence).astype(np.int64)
  if q.shape != k.shape or q.ndim != 2 or ev.shape != q.shape[:1]:
    raise ValueError(f"need q, k [N, D] and evidence [N], got {q.shape}, {k.shape}, {ev.shape}")
  cos = np.sum(_unit(q) * _unit(k), axis=-1)
  G = int(ev.max()) + 1 if num_groups is None else int(num_groups)
  keep = (ev >= 0) & (ev < G)

  def by_ev(values):
    count = np.bincount(ev[keep], minlength=G).astype(np.float64)
    total = np.bincount(ev[keep], weights=values[keep], minlength=G)
    with np.errstate(invalid="ignore", divide="ignore"):
      return np.where(count > 0, total / count, np.nan), count

  align, count = by_ev(cos)
  slope_raw = _slope(ev[keep].astype(np.float64), cos[keep])
  out = {"alignment": align, "count": count, "slope_raw": slope_raw, "cos": cos}
  if distance is None:
    out.update(slope=slope_raw, alignment_adjusted=align, distance_groups=0)
    return out
  dist = np.asarray(distance).astype(np.int64)
  if dist.shape != ev.shape:
    raise ValueError(f"need distance [N], got {dist.shape}")
  d, e, c = dist[keep], ev[keep].astype(np.float64), cos[keep]
  e_res = partial_out(e, strata=d)
  c_res = partial_out(c, strata=d)
  den = float((e_res * e_res).sum())
  slope = float((e_res * c_res).sum() / den) if den > 1e-12 else float("nan")
  # the distance effect, estimated jointly with the evidence slope (two-way fit), is removed;
  # demeaning the cosine within distance alone would also remove the part of the evidence effect
  # that is collinear with distance and flatten the curve
  e_mean_d = e - e_res
  adj = np.full(len(cos), np.nan)
  adj[keep] = c_res + (slope if np.isfinite(slope) else 0.0) * (e_mean_d - e.mean()) + c.mean()
  align_adj, _ = by_ev(np.nan_to_num(adj))
  _, cnt_d = np.unique(d, return_counts=True)
  out.update(slope=slope, alignment_adjusted=align_adj, distance_groups=int((cnt_d > 1).sum()))
  return out


def pca_vs_entropy(states, entropy, k: int = 3, strata=None, covariates=None) -> dict:
  """Leading principal components of states and how they track the posterior entropy.

  states [N, D] (e.g. residual states at supervised positions), entropy [N] in bits.
  With `strata` (e.g. the position of each state) and/or `covariates`, both the states and the
  entropy are first residualised on them (`partial_out`): PCA then finds the directions of
  variation *within* a position, and the correlations are partial correlations.
  Returns `explained_variance_ratio [k]`, `components [k, D]`, `projections [N, k]`,
  `corr_pc1_entropy` (Pearson; sign is arbitrary, as PCA's), `abs_corr_pc1_entropy`,
  `corr_entropy [k]` for each of the k components, and `entropy_std` (of the entropy left after
  partialling out; near 0 means nothing is left to explain).

  Controls for (with `strata`): position, which drives both the states and, on bijection
  new-key positions, the entropy (old definition: all supervised positions, nothing partialled
  out, where a "key seen before" flag or the position alone gives a large correlation).
  """
  X = np.asarray(states, np.float64)
  h = np.asarray(entropy, np.float64)
  if X.ndim != 2 or h.shape != X.shape[:1]:
    raise ValueError(f"need states [N, D] and entropy [N], got {X.shape}, {h.shape}")
  k = int(min(k, X.shape[1], X.shape[0]))
  Xc = partial_out(X, strata, covariates)
  hc = partial_out(h, strata, covariates)
  _, s, vt = np.linalg.svd(Xc, full_matrices=False)
  var = s**2
  evr = var[:k] / max(var.sum(), 1e-300)
  proj = Xc @ vt[:k].T
  corr = np.array([_pearson(proj[:, i], hc) for i in range(k)])
  return {
    "explained_variance_ratio": evr,
    "components": vt[:k],
    "projections": proj,
    "corr_entropy": corr,
    "corr_pc1_entropy": float(corr[0]),
    "abs_corr_pc1_entropy": float(abs(corr[0])),
    "entropy_std": float(hc.std()),
  }


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
  a, b = a - a.mean(), b - b.mean()
  den = np.sqrt((a * a).sum() * (b * b).sum())
  return float((a * b).sum() / den) if den > 1e-12 else 0.0


def relative_drift(series) -> np.ndarray:
  """||x_{c+1} - x_c|| / ||x_c|| between consecutive checkpoints; series [C, ...] -> [C-1].

  The old, norm-based drift (kept for comparison): a norm that changes during training moves
  it even when nothing else does. `drift` uses norm-free measures instead."""
  x = np.asarray(series, np.float64)
  if x.ndim < 1 or x.shape[0] < 2:
    raise ValueError(f"need at least two checkpoints, got shape {x.shape}")
  x = x.reshape(x.shape[0], -1)
  diff = np.linalg.norm(np.diff(x, axis=0), axis=-1)
  return diff / np.maximum(np.linalg.norm(x[:-1], axis=-1), 1e-12)


def attention_tv(series) -> np.ndarray:
  """Mean total-variation distance between attention rows (distributions over the last axis)
  at consecutive checkpoints: series [C, ..., S] -> [C-1], each in [0, 1]."""
  a = np.asarray(series, np.float64)
  return 0.5 * np.abs(np.diff(a, axis=0)).sum(-1).reshape(a.shape[0] - 1, -1).mean(-1)


def vector_angle(series) -> np.ndarray:
  """Mean angle (radians) between vectors (last axis) at consecutive checkpoints, e.g. the
  value vector of each token and head: series [C, ..., D] -> [C-1]. Blind to norms."""
  u = _unit(np.asarray(series, np.float64))
  cos = np.clip(np.sum(u[1:] * u[:-1], axis=-1), -1.0, 1.0)
  return np.arccos(cos).reshape(u.shape[0] - 1, -1).mean(-1)


def drift(
  attn_series, value_series, steps=None, *, min_checkpoints: int = MIN_DRIFT_CHECKPOINTS
) -> dict:
  """Attention-pattern drift vs value drift across checkpoints, in norm-free units per step.

  attn_series [C, ..., S] (attention probabilities on a fixed probe batch at C checkpoints),
  value_series [C, ..., D] (value vectors on the same batch), steps [C] (training steps of the
  checkpoints; default 0..C-1). Needs C >= `min_checkpoints` (5) spread through training.
  Returns `attn_drift [C-1]` (mean total-variation distance of attention rows per 1000 steps),
  `value_drift [C-1]` (mean angle of value vectors in radians per 1000 steps), `attn_fall` and
  `value_fall` (last interval's rate over the first's: how far each has settled), `attn_half` /
  `value_half` (first interval whose rate is at most half the first one; C-1 if never), and
  `attention_settles_first`: attention's rate fell by at least 1/SETTLE_MARGIN (2x) more than
  the values'. `attn_drift_relative` / `value_drift_relative`: the old norm-based per-interval
  drift, for comparison.

  Controls for: norms that change during training (old: ||x_{c+1} - x_c|| / ||x_c||, where a
  shrinking value norm reads as rising drift), too few checkpoints (old default: 2, one
  interval, so "settles first" was always False), and uneven spacing (rates are per step).
  """
  a = np.asarray(attn_series, np.float64)
  v = np.asarray(value_series, np.float64)
  C = a.shape[0]
  if C < min_checkpoints or v.shape[0] != C:
    raise ValueError(
      f"drift needs at least {min_checkpoints} checkpoints for both series, "
      f"got {a.shape[0]} and {v.shape[0]}"
    )
  st = np.arange(C, dtype=np.float64) if steps is None else np.asarray(steps, np.float64)
  if st.shape != (C,) or np.any(np.diff(st) <= 0):
    raise ValueError(f"steps must be {C} increasing numbers, got {steps!r}")
  scale = 1000.0 if steps is not None else 1.0
  dt = np.diff(st) / scale
  ad, vd = attention_tv(a) / dt, vector_angle(v) / dt

  def fall(d):
    return float(d[-1] / d[0]) if d[0] > 0 else 0.0

  def half(d):
    hit = np.nonzero(d <= 0.5 * d[0])[0]
    return int(hit[0]) if hit.size else len(d)

  af, vf = fall(ad), fall(vd)
  return {
    "steps": st,
    "attn_drift": ad,
    "value_drift": vd,
    "attn_fall": af,
    "value_fall": vf,
    "attn_half": half(ad),
    "value_half": half(vd),
    "attention_settles_first": bool(af < SETTLE_MARGIN * vf),
    "attn_drift_relative": relative_drift(a),
    "value_drift_relative": relative_drift(v),
  }
