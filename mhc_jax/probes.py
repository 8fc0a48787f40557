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


# ----------------------------------------------------------------- the papers' own definitions
# arXiv:2512.22471 (Paper I) and 2512.23752 (Paper III), as their released code computes them
# (github.com/vishalmisra/bayesian-wind-tunnel; docs/windtunnel_results.md says which file).
# Each comes with its null: random directions (key orthogonality), permuted evidence (q-k
# alignment slope), permuted entropy (value manifold).


def offdiag_abs_cos(x) -> float:
  """Mean |cos| between the rows of `x [n, D]` over the n (n - 1) ordered off-diagonal pairs."""
  u = _unit(np.asarray(x, np.float64))
  n = len(u)
  if n < 2:
    raise ValueError("offdiag_abs_cos needs at least two rows")
  return float(np.abs((u @ u.T)[~np.eye(n, dtype=bool)]).mean())


def _random_abs_cos_draws(n: int, dim: int, draws: int, seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  return np.array([offdiag_abs_cos(rng.standard_normal((n, dim))) for _ in range(draws)])


def token_key_orthogonality(keys, *, draws: int = 200, seed: int = 0) -> dict:
  """Paper I's key orthogonality: the keys of the hypothesis tokens themselves.

  keys [V, H, D]: for each of V hypothesis tokens (bijection: the key symbols) and each head,
  the key the token's embedding gets from one layer's key projection (no position, no context;
  the authors' `qkv_analysis.py orthogonality`: `K = E[0:V] @ W_K[h]`). Per head: mean |cos|
  between the V keys, uncentred (`mean_abs_cos_by_head [H]`; `mean_signed_cos_by_head`, the
  signed mean the authors' script writes). Null: V isotropic random directions in D dimensions,
  `draws` seeded draws (`random_mean_abs_cos` ~ sqrt(2 / (pi D)), `random_std`); `ratio_to_random`
  (head mean / null mean; < 1: more orthogonal than chance) and `z` (head mean minus null mean in
  null standard deviations of a head mean over H heads). `cos [V, V]`: the cosine matrix of the
  keys with all heads concatenated (what a figure shows), with `concat_mean_abs_cos` and its own
  random reference `concat_random_mean_abs_cos` (V directions in H*D dimensions)."""
  k = np.asarray(keys, np.float64)
  if k.ndim != 3 or k.shape[0] < 2:
    raise ValueError(f"need keys [V >= 2, H, D], got {k.shape}")
  V, H, D = k.shape
  per_head = np.array([offdiag_abs_cos(k[:, h]) for h in range(H)])
  off = ~np.eye(V, dtype=bool)
  signed = np.array([float((_unit(k[:, h]) @ _unit(k[:, h]).T)[off].mean()) for h in range(H)])
  null = _random_abs_cos_draws(V, D, draws, seed)
  flat = _unit(k.reshape(V, H * D))
  cos = flat @ flat.T
  mean = float(per_head.mean())
  sd_mean = float(null.std()) / np.sqrt(H)
  return {
    "mean_abs_cos": mean,
    "mean_abs_cos_by_head": per_head,
    "mean_signed_cos_by_head": signed,
    "random_mean_abs_cos": float(null.mean()),
    "random_std": float(null.std()),
    "ratio_to_random": mean / float(null.mean()),
    "z": (mean - float(null.mean())) / sd_mean if sd_mean > 0 else float("nan"),
    "cos": cos,
    "concat_mean_abs_cos": float(np.abs(cos[off]).mean()),
    "concat_random_mean_abs_cos": float(_random_abs_cos_draws(V, H * D, 16, seed + 1).mean()),
  }


def weight_key_orthogonality(kernel, *, draws: int = 200, seed: int = 0) -> dict:
  """Paper III's key orthogonality (Sec. 4.2): the D columns of each head's key projection
  W_K [C, H, D] (each a direction in the C-dimensional model space), mean |cos| between them
  per head. Null: D isotropic random directions in C dimensions (the paper's Gaussian
  baseline, sqrt(2 / (pi C))). Returns `mean_abs_cos` (mean over heads), `..._by_head [H]`,
  `random_mean_abs_cos`, `random_std`, `ratio_to_random`."""
  w = np.asarray(kernel, np.float64)
  if w.ndim != 3 or w.shape[2] < 2:
    raise ValueError(f"need a key kernel [C, H, D >= 2], got {w.shape}")
  C, H, D = w.shape
  per_head = np.array([offdiag_abs_cos(w[:, h, :].T) for h in range(H)])
  null = _random_abs_cos_draws(D, C, draws, seed)
  return {
    "mean_abs_cos": float(per_head.mean()),
    "mean_abs_cos_by_head": per_head,
    "random_mean_abs_cos": float(null.mean()),
    "random_std": float(null.std()),
    "ratio_to_random": float(per_head.mean() / null.mean()),
  }


def _strata_perm(rng, x: np.ndarray, strata) -> np.ndarray:
  if strata is None:
    return rng.permutation(x)
  out = x.copy()
  for s in np.unique(strata):
    idx = np.nonzero(strata == s)[0]
    out[idx] = x[rng.permutation(idx)]
  return out


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
  """Least-squares slope of `values [N]` (e.g. a per-query q-k alignment) on `evidence [N]`,
  against its null: the same slope with the evidence labels permuted (`permutations` seeded
  draws). With `strata [N]` (e.g. the query position) the slope is taken within strata (both
  demeaned per stratum) and the evidence is permuted within strata, so a trend that is only
  position does not count. Returns `slope`, `null_mean`, `null_std`, `z`, `p` (two-sided,
  (1 + #{|null| >= |slope|}) / (1 + permutations)), `points`."""
  y = np.asarray(values, np.float64)
  e = np.asarray(evidence, np.float64)
  if y.ndim != 1 or e.shape != y.shape:
    raise ValueError(f"need values [N] and evidence [N], got {y.shape}, {e.shape}")
  st = None if strata is None else np.asarray(strata)
  y_res = partial_out(y, strata=st)

  def slope(ev):
    r = partial_out(ev, strata=st)
    den = float((r * r).sum())
    return float((r * y_res).sum() / den) if den > 1e-12 else 0.0

  s = slope(e)
  rng = np.random.default_rng(seed)
  null = np.array([slope(_strata_perm(rng, e, st)) for _ in range(permutations)])
  return {"slope": s, "points": int(len(y)), **_null_summary(s, null)}


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
  rank = lambda x: np.argsort(np.argsort(x, kind="stable"), kind="stable").astype(np.float64)
  return _pearson(rank(a), rank(b))


def value_manifold(
  values, entropy, *, k: int = 3, strata=None, permutations: int = 1000, seed: int = 0
) -> dict:
  """Paper III's value manifold (Sec. 4.2): PCA of last-layer value vectors (all heads
  concatenated) with every coordinate standardised over the samples, and how PC1 tracks the
  posterior entropy.

  values [N, D], entropy [N] (bits). Returns `explained_variance_ratio [k]` (the papers report
  PC1 84-90% on their wind tunnels), `pc1_variance_random` (PC1's share for Gaussian data of the
  same N x D, standardised alike: the chance level, ~1/D plus sampling), `projections [N, 2]`,
  `corr_pc1_entropy` (Pearson; `spearman_pc1_entropy`, which the authors' Paper III script
  uses), `abs_corr_pc1_entropy` and its null: the entropy labels permuted (`permutations`
  draws; `null_mean`, `null_std`, `z`, `p` of |r|). With `strata` (e.g. position) the values and
  the entropy are demeaned within strata before standardising, and the entropy is permuted
  within strata: the correlation then is what is left beyond position. `permutations=0`: no
  null (the null keys are absent)."""
  X = np.asarray(values, np.float64)
  h = np.asarray(entropy, np.float64)
  if X.ndim != 2 or h.shape != X.shape[:1] or len(h) < 3:
    raise ValueError(f"need values [N >= 3, D] and entropy [N], got {X.shape}, {h.shape}")
  st = None if strata is None else np.asarray(strata)

  def standardised_pca(A):
    A = partial_out(A, strata=st)
    sd = A.std(axis=0)
    A = A[:, sd > 1e-12] / sd[sd > 1e-12]
    _, s, vt = np.linalg.svd(A, full_matrices=False)
    return A, s**2 / max(float((s**2).sum()), 1e-300), vt

  Xs, evr, vt = standardised_pca(X)
  proj = Xs @ vt[: min(2, len(vt))].T
  hc = partial_out(h, strata=st)
  r = _pearson(proj[:, 0], hc)
  rng = np.random.default_rng(seed)
  null = np.array(
    [
      abs(_pearson(proj[:, 0], partial_out(_strata_perm(rng, h, st), strata=st)))
      for _ in range(permutations)
    ]
  )
  nulls = _null_summary(abs(r), null) if permutations > 0 else {}
  _, evr_rand, _ = standardised_pca(np.random.default_rng(seed + 1).standard_normal(X.shape))
  kk = int(min(k, len(evr)))
  return {
    "explained_variance_ratio": evr[:kk],
    "pc1_variance": float(evr[0]),
    "pc1_variance_random": float(evr_rand[0]),
    "projections": proj,
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
  """Paper I's frame-precision dissociation ("the manifold unfurls while attention patterns
  remain stable"), as an order of settling over checkpoints.

  steps [C], frame_dist [C]: distance of each checkpoint's attention patterns to the final
  checkpoint's (e.g. mean total variation; 0 at the end), precision [C]: a measure that improves
  as the value geometry sharpens (e.g. |corr(PC1 of values, entropy)|, or -KL). Each series'
  settling step is where it has covered `frac` of its change for good (`settle_step`); the
  frame settles first when its step is earlier. Returns `frame_settled_step`,
  `precision_settled_step`, `frame_first` (bool), `steps`."""
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
