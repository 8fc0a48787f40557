"""Geometry probes on synthetic arrays with known answers."""

import numpy as np
import pytest

from mhc_jax import probes


def test_key_orthogonality_known_geometries():
    rng = np.random.default_rng(0)
    ids = np.repeat(np.arange(4), 25)
    orth = np.eye(16)[ids] + 0.02 * rng.normal(size=(100, 16))
    r = probes.key_orthogonality(orth, ids)
    assert r["cos"].shape == (4, 4) and list(r["hypotheses"]) == [0, 1, 2, 3]
    assert r["mean_abs_cos"] < 0.02 and r["within_cos"] > 0.99
    np.testing.assert_allclose(np.diag(r["cos"]), 1.0)
    # two hypotheses 60 degrees apart: cosine exactly 0.5
    a, b = np.array([1.0, 0.0]), np.array([0.5, np.sqrt(3) / 2])
    r = probes.key_orthogonality(np.stack([a, a, b]), np.array([7, 7, 9]))
    assert r["mean_abs_cos"] == pytest.approx(0.5) and r["max_abs_cos"] == pytest.approx(0.5)
    # a shared offset hides orthogonality; centring removes it: simplex cosines -1/(H-1)
    shifted = 5.0 + np.eye(16)[ids]
    assert probes.key_orthogonality(shifted, ids)["mean_abs_cos"] > 0.9
    c = probes.key_orthogonality(shifted, ids, center=True)["cos"]
    np.testing.assert_allclose(c[~np.eye(4, dtype=bool)], -1 / 3, atol=1e-9)
    with pytest.raises(ValueError):
        probes.key_orthogonality(orth, np.zeros(100, int))


def test_qk_alignment_sharpens_with_evidence():
    rng = np.random.default_rng(1)
    want = np.array([0.1, 0.3, 0.5, 0.7, 0.9])
    ev = np.repeat(np.arange(5), 40)
    k = rng.normal(size=(200, 8))
    perp = rng.normal(size=(200, 8))
    perp -= np.sum(perp * k, -1, keepdims=True) / np.sum(k * k, -1, keepdims=True) * k
    ku, pu = k / np.linalg.norm(k, axis=-1, keepdims=True), perp / np.linalg.norm(perp, axis=-1, keepdims=True)
    c = want[ev][:, None]
    q = 3.0 * (c * ku + np.sqrt(1 - c**2) * pu)  # cos(q, k) = want[evidence] exactly
    r = probes.qk_alignment_by_evidence(q, k, ev)
    np.testing.assert_allclose(r["alignment"], want, atol=1e-9)
    np.testing.assert_array_equal(r["count"], 40)
    assert r["slope"] == pytest.approx(0.2)
    r = probes.qk_alignment_by_evidence(q, k, ev, num_groups=7)
    assert np.isnan(r["alignment"][5:]).all() and r["count"][5:].sum() == 0


def test_pca_leading_component_tracks_entropy():
    rng = np.random.default_rng(2)
    h = rng.uniform(0, 3, size=400)
    u = rng.normal(size=12)
    u /= np.linalg.norm(u)
    r = probes.pca_vs_entropy(np.outer(h, u) + 7.0, h, k=3)  # rank one (plus an offset)
    np.testing.assert_allclose(r["explained_variance_ratio"], [1, 0, 0], atol=1e-9)
    assert r["abs_corr_pc1_entropy"] == pytest.approx(1.0)
    np.testing.assert_allclose(abs(r["components"][0] @ u), 1.0)
    noisy = np.outer(h, u) * 4 + rng.normal(size=(400, 12)) * 0.1
    r = probes.pca_vs_entropy(noisy, h, k=3)
    assert r["explained_variance_ratio"][0] > 0.95 and r["abs_corr_pc1_entropy"] > 0.99
    assert r["projections"].shape == (400, 3) and abs(r["corr_entropy"][1]) < 0.2
    # entropy unrelated to the dominant direction: PC1 does not track it
    r = probes.pca_vs_entropy(noisy, rng.uniform(0, 3, size=400))
    assert r["abs_corr_pc1_entropy"] < 0.2


def test_drift_attention_settles_first():
    rng = np.random.default_rng(3)
    C = 8
    A, dA = rng.uniform(size=(4, 16, 16)) + 10, rng.normal(size=(4, 16, 16))
    Vv, dV = rng.normal(size=(4, 16, 32)) + 10, rng.normal(size=(4, 16, 32))
    attn = np.stack([A + 0.3**c * dA for c in range(C)])
    vals = np.stack([Vv + 0.8**c * dV for c in range(C)])
    r = probes.drift(attn, vals)
    assert r["attn_drift"].shape == (C - 1,) and r["value_drift"].shape == (C - 1,)
    # x_{c+1} - x_c = r^c (r - 1) d, so drift falls by about r^(C-2)
    assert r["attn_fall"] == pytest.approx(0.3 ** (C - 2), rel=0.05)
    assert r["value_fall"] == pytest.approx(0.8 ** (C - 2), rel=0.05)
    assert r["attention_settles_first"] and r["attn_half"] == 1 and r["value_half"] == 4
    assert not probes.drift(vals, attn)["attention_settles_first"]
    exact = np.linalg.norm((attn[1:] - attn[:-1]).reshape(C - 1, -1), axis=-1) / np.linalg.norm(
        attn[:-1].reshape(C - 1, -1), axis=-1
    )
    np.testing.assert_allclose(r["attn_drift"], exact)
    with pytest.raises(ValueError):
        probes.relative_drift(attn[:1])
