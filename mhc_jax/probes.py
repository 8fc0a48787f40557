"""Geometry probes: pure numpy functions over arrays a caller extracts from a trained model.

They measure the geometry the wind-tunnel papers report for Bayesian in-context inference:

- `key_orthogonality`: keys belonging to different hypotheses (e.g. different bijection keys)
  point in nearly orthogonal directions.
- `qk_alignment_by_evidence`: the query at a position aligns more and more with the key it should
  retrieve as evidence accumulates.
- `pca_vs_entropy`: residual states lie on a low-dimensional manifold whose leading coordinate
  tracks the posterior entropy.
- `drift`: across checkpoints, attention patterns settle before the values stop changing.

Inputs may be numpy or jax arrays; outputs are numpy arrays and Python floats.
"""

from __future__ import annotations

import numpy as np


def _unit(x: np.ndarray, axis: int = -1, eps: float = 1e-12) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=axis, keepdims=True), eps)


def key_orthogonality(keys, hypothesis_ids, *, center: bool = False) -> dict:
    """How orthogonal the mean key directions of different hypotheses are.

    keys [N, D], hypothesis_ids [N] int. The keys of each hypothesis are averaged (after
    subtracting the global mean when `center`), normalised, and compared by cosine.
    Returns `cos [H, H]` (hypotheses in sorted id order, `hypotheses [H]`), `mean_abs_cos` and
    `max_abs_cos` over off-diagonal pairs (0 = orthogonal), and `within_cos`, the mean cosine of
    individual keys to their own hypothesis direction (1 = consistent).
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
    return {
        "hypotheses": hyps,
        "cos": cos,
        "mean_abs_cos": float(np.abs(cos[off]).mean()),
        "max_abs_cos": float(np.abs(cos[off]).max()),
        "within_cos": float(within.mean()),
    }


def qk_alignment_by_evidence(q, k, evidence, num_groups: int | None = None) -> dict:
    """Cosine between each query and the key it should attend to, grouped by evidence.

    q [N, D] queries, k [N, D] the matching (target) keys, evidence [N] int (e.g. number of
    distinct values revealed). Returns `alignment [G]` (mean cosine per evidence value, NaN where
    empty), `count [G]`, `slope` (least-squares slope of cosine against evidence; > 0 = sharpening)
    and `cos [N]`.
    """
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    ev = np.asarray(evidence).astype(np.int64)
    if q.shape != k.shape or q.ndim != 2 or ev.shape != q.shape[:1]:
        raise ValueError(f"need q, k [N, D] and evidence [N], got {q.shape}, {k.shape}, {ev.shape}")
    cos = np.sum(_unit(q) * _unit(k), axis=-1)
    G = int(ev.max()) + 1 if num_groups is None else int(num_groups)
    keep = (ev >= 0) & (ev < G)
    count = np.bincount(ev[keep], minlength=G).astype(np.float64)
    total = np.bincount(ev[keep], weights=cos[keep], minlength=G)
    with np.errstate(invalid="ignore", divide="ignore"):
        align = np.where(count > 0, total / count, np.nan)
    slope = float(np.polyfit(ev[keep], cos[keep], 1)[0]) if np.unique(ev[keep]).size > 1 else 0.0
    return {"alignment": align, "count": count, "slope": slope, "cos": cos}


def pca_vs_entropy(states, entropy, k: int = 3) -> dict:
    """Leading principal components of states and how PC1 tracks the posterior entropy.

    states [N, D] (e.g. residual states at supervised positions), entropy [N] in bits.
    Returns `explained_variance_ratio [k]`, `components [k, D]`, `projections [N, k]`,
    `corr_pc1_entropy` (Pearson; sign is arbitrary, as PCA's), `abs_corr_pc1_entropy`, and
    `corr_entropy [k]` for each of the k components.
    """
    X = np.asarray(states, np.float64)
    h = np.asarray(entropy, np.float64)
    if X.ndim != 2 or h.shape != X.shape[:1]:
        raise ValueError(f"need states [N, D] and entropy [N], got {X.shape}, {h.shape}")
    k = int(min(k, X.shape[1], X.shape[0]))
    Xc = X - X.mean(axis=0, keepdims=True)
    _, s, vt = np.linalg.svd(Xc, full_matrices=False)
    var = s**2
    evr = var[:k] / max(var.sum(), 1e-300)
    proj = Xc @ vt[:k].T
    corr = np.array([_pearson(proj[:, i], h) for i in range(k)])
    return {
        "explained_variance_ratio": evr,
        "components": vt[:k],
        "projections": proj,
        "corr_entropy": corr,
        "corr_pc1_entropy": float(corr[0]),
        "abs_corr_pc1_entropy": float(abs(corr[0])),
    }


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    den = np.sqrt((a * a).sum() * (b * b).sum())
    return float((a * b).sum() / den) if den > 0 else 0.0


def relative_drift(series) -> np.ndarray:
    """||x_{c+1} - x_c|| / ||x_c|| between consecutive checkpoints; series [C, ...] -> [C-1]."""
    x = np.asarray(series, np.float64)
    if x.ndim < 1 or x.shape[0] < 2:
        raise ValueError(f"need at least two checkpoints, got shape {x.shape}")
    x = x.reshape(x.shape[0], -1)
    diff = np.linalg.norm(np.diff(x, axis=0), axis=-1)
    return diff / np.maximum(np.linalg.norm(x[:-1], axis=-1), 1e-12)


def drift(attn_series, value_series) -> dict:
    """Attention-pattern drift vs value drift across checkpoints.

    attn_series [C, ...] (e.g. attention probabilities on a fixed probe batch at C checkpoints),
    value_series [C, ...] (e.g. value vectors, or the attention output, on the same batch).
    Returns `attn_drift [C-1]`, `value_drift [C-1]`, `attn_fall` and `value_fall` (last drift
    over first drift: how far each has settled), `attn_half` / `value_half` (first interval
    whose drift is at most half the first one; C-1 if never), and `attention_settles_first`
    (attention's drift fell by a larger factor than the values').
    """
    a, v = relative_drift(attn_series), relative_drift(value_series)

    def fall(d):
        return float(d[-1] / d[0]) if d[0] > 0 else 0.0

    def half(d):
        hit = np.nonzero(d <= 0.5 * d[0])[0]
        return int(hit[0]) if hit.size else len(d)

    af, vf = fall(a), fall(v)
    return {
        "attn_drift": a,
        "value_drift": v,
        "attn_fall": af,
        "value_fall": vf,
        "attn_half": half(a),
        "value_half": half(v),
        "attention_settles_first": bool(af < vf),
    }
