"""Tests for mhc_jax.sinkhorn: projection accuracy, invariances, an independent OT check,
transforms, gradients (unrolled and implicit), dtypes and the implicit mode's memory.

Compilation dominates the run time on a loaded CPU, so each test gathers its work into one or
two jitted calls."""

import functools

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from mhc_jax import sinkhorn as sk
from mhc_jax.sinkhorn import sinkhorn, stochastic_error

MODES = ("unroll", "implicit")
_proj = jax.jit(sinkhorn, static_argnames=("iters", "grad"))


def _logits(seed, shape, scale=1.0):
  """N(0, scale^2) float32 logits from numpy (no per-shape RNG compilation)."""
  return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def _loss(z, w, iters, mode):
  return jnp.sum(w * sinkhorn(z, iters, mode))


_grad = jax.jit(jax.grad(_loss), static_argnums=(2, 3))


def _errors(p):
  """Per-matrix (row_err, col_err) for p [b, n, n]."""
  return jnp.max(jnp.abs(p.sum(-1) - 1), -1), jnp.max(jnp.abs(p.sum(-2) - 1), -1)


# --- projection accuracy -------------------------------------------------------------------


def test_doubly_stochastic_after_20_iters():
  scales = np.repeat([0.1, 1.0, 3.0], 6)[:, None, None].astype(np.float32)  # 6 matrices each

  zs = [scales * _logits(n, (18, n, n)) for n in (2, 4, 8)]
  errs = jax.device_get(jax.jit(lambda zs: [_errors(sinkhorn(z)) for z in zs])(zs))
  for n, (row, col) in zip((2, 4, 8), errs):
    assert row.max() < 1e-6, (n, row)  # ends on a row step: rows exact
    assert col[:12].max() < 1e-3, (n, col)  # scales 0.1 and 1
    # Peaked logits (std 3) converge slowly: 20 iterations leave O(1e-2) in the columns
    # (see the next test: about 50 iterations reach 1e-3).
    assert col[12:].max() < 0.1, (n, col)
  p = _proj(zs[1])
  chex.assert_shape(p, (18, 4, 4))
  chex.assert_type(p, jnp.float32)
  assert np.all(np.asarray(p) >= 0)


def test_column_error_falls_with_iterations():
  z = _logits(0, (16, 8, 8), 3.0)
  iters = (1, 2, 5, 10, 20, 50, 100)
  errs = np.array(jax.jit(lambda z: [stochastic_error(sinkhorn(z, k)) for k in iters])(z))
  print("\n iters   row_err    col_err   (s=3, n=8, max over 16 matrices)")
  for k, (row_err, col_err) in zip(iters, errs):
    print(f"{k:6d}  {row_err:.2e}  {col_err:.3e}")
  assert errs[:, 0].max() < 1e-6
  col = errs[:, 1]
  assert all(b <= a + 1e-6 for a, b in zip(col, col[1:])), col
  assert col[iters.index(50)] < 1e-2 * col[0], col


def test_any_leading_shape_and_stochastic_error():
  z = _logits(1, (2, 3, 4, 4))
  p = _proj(z)
  chex.assert_shape(p, (2, 3, 4, 4))
  chex.assert_trees_all_close(p[1, 2], _proj(z[1, 2]), atol=1e-7)
  m = jnp.array([[0.5, 0.5], [0.2, 0.9]])  # rows 1.0, 1.1; columns 0.7, 1.4
  row_err, col_err = stochastic_error(m)
  chex.assert_trees_all_close((row_err, col_err), (0.1, 0.4), atol=1e-6)
  chex.assert_type((row_err, col_err), jnp.float32)


def test_bad_arguments_raise():
  z = jnp.zeros((4, 4))
  with pytest.raises(ValueError, match="grad"):
    sinkhorn(z, grad="exact")
  for bad in (0, -1, 2.0, True):
    with pytest.raises(ValueError, match="iters"):
      sinkhorn(z, iters=bad)
  for shape in ((3, 4), (4,), (2, 4, 3)):
    with pytest.raises(ValueError, match="logits"):
      sinkhorn(jnp.zeros(shape))


# --- invariances and known values ----------------------------------------------------------


def test_invariances_and_known_values():
  z = _logits(2, (6, 4, 4), 2.0)
  r, c = _logits(3, (6, 4, 1), 5.0), _logits(4, (6, 1, 4), 5.0)
  rng = np.random.default_rng(0)
  pm = np.eye(4, dtype=np.float32)[rng.permutation(4)]
  qm = np.eye(4, dtype=np.float32)[rng.permutation(4)]
  p, p_c, p_rc, p_perm = np.asarray(_proj(np.stack([z, z + c, z + r + c, pm @ z @ qm]), 200))
  # Column shifts cancel exactly in the first (column) step; row shifts at convergence.
  chex.assert_trees_all_close(p_c, p, atol=1e-6)
  chex.assert_trees_all_close(p_rc, p, atol=1e-5)
  chex.assert_trees_all_close(p_perm, pm @ p @ qm, atol=1e-6)  # S(P Z Q) = P S(Z) Q

  chex.assert_trees_all_close(_proj(np.array([[[7.3]], [[-2.0]]])), np.ones((2, 1, 1)))
  chex.assert_trees_all_close(_proj(np.full((4, 4), 3.7)), np.full((4, 4), 0.25), atol=1e-7)


def _entropic_ot_plan(cost, eps=1.0, iters=5000):
  """Plain numpy float64 Sinkhorn for min <P, C> - eps H(P), marginals uniform 1/n."""
  n = cost.shape[0]
  k = np.exp(-cost / eps)
  u, v = np.ones(n), np.ones(n)
  for _ in range(iters):
    u = (1.0 / n) / (k @ v)
    v = (1.0 / n) / (k.T @ u)
  return u[:, None] * k * v[None, :]


def test_matches_independent_entropic_ot():
  n = 5
  z = _logits(10, (n, n))
  plan = _entropic_ot_plan(-np.asarray(z, np.float64))
  np.testing.assert_allclose(n * plan.sum(0), 1.0, atol=1e-12)  # the reference converged
  np.testing.assert_allclose(n * plan.sum(1), 1.0, atol=1e-12)
  np.testing.assert_allclose(_proj(z, 200), n * plan, atol=2e-6)


# --- transforms and gradients --------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_jit_vmap_grad_jacrev(mode):
  z, w = _logits(20, (2, 3, 4, 4)), _logits(21, (2, 3, 4, 4))
  f = functools.partial(sinkhorn, iters=20, grad=mode)
  grad = jax.grad(functools.partial(_loss, iters=20, mode=mode))

  @jax.jit
  def everything(z, w):
    return (
      jax.vmap(jax.vmap(f))(z),
      grad(z, w),
      jax.vmap(jax.vmap(grad))(z, w),
      jax.jacrev(f)(z[0, 0]),
    )

  p, g, g_vv, jac = jax.device_get(everything(z, w))
  chex.assert_trees_all_close(p, _proj(z, 20, mode), atol=1e-6)
  chex.assert_shape(g, z.shape)
  chex.assert_tree_all_finite((g, jac))
  chex.assert_trees_all_close(g_vv, g, atol=1e-6)
  # S is invariant to column shifts of Z (and to row shifts once converged), so the gradient
  # sums to ~0 along both axes.
  np.testing.assert_allclose(g.sum(-1), 0.0, atol=1e-5)
  np.testing.assert_allclose(g.sum(-2), 0.0, atol=1e-5)
  chex.assert_shape(jac, (4, 4, 4, 4))
  # Row sums are exactly 1 for every Z, so their derivative vanishes; jac @ w matches grad.
  np.testing.assert_allclose(jac.sum(1), 0.0, atol=1e-5)
  np.testing.assert_allclose(np.einsum("ij,ijkl->kl", w[0, 0], jac), g[0, 0], atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_gradient_matches_finite_differences_float64(mode):
  # Scoped x64: float64 logits run the projection in float64 (it computes in >= float32).
  with jax.enable_x64(True):
    n, h = 3, 1e-6
    z, w = _logits(30, (n, n)).astype(np.float64), _logits(31, (n, n)).astype(np.float64)
    # "implicit" differentiates the converged projection, so converge the forward pass.
    iters = 300 if mode == "implicit" else 7
    g = _grad(z, w, iters, mode)
    chex.assert_type(g, jnp.float64)
    steps = h * np.eye(n * n).reshape(n * n, n, n)
    losses = np.asarray(
      jax.jit(jax.vmap(lambda d: _loss(z + d, w, iters, mode)))(np.concatenate([steps, -steps]))
    )
    fd = ((losses[: n * n] - losses[n * n :]) / (2 * h)).reshape(n, n)
    np.testing.assert_allclose(g, fd, atol=1e-8)
  assert jnp.ones(1).dtype == jnp.float32  # x64 did not leak


def test_implicit_and_unrolled_gradients_agree():
  z, w = _logits(40, (16, 4, 4)), _logits(41, (16, 4, 4))
  both = jax.jit(lambda z, w: [jax.grad(_loss)(z, w, 50, m) for m in MODES])
  g_unroll, g_implicit = both(z, w)
  chex.assert_trees_all_close(g_implicit, g_unroll, atol=1e-4)
  # Very peaked logits (P entries underflow to 0): still finite, still shift-invariant. The two
  # modes differ here because 50 iterations are far from converged.
  grads = jax.device_get(both(30.0 * z, w))
  chex.assert_tree_all_finite(grads)
  for g in grads:  # column shifts are invariant even for the truncated iteration
    np.testing.assert_allclose(g.sum(-2), 0.0, atol=1e-5)
  np.testing.assert_allclose(grads[1].sum(-1), 0.0, atol=1e-5)


def test_bf16_in_float32_out():
  z16 = _logits(60, (4, 4, 4), 2.0).astype(jnp.bfloat16)
  p, p32, grads = jax.jit(
    lambda z: (
      sinkhorn(z),
      sinkhorn(z.astype(jnp.float32)),
      [jax.grad(_loss)(z, 1.0, 20, m) for m in MODES],
    )
  )(z16)
  chex.assert_type(p, jnp.float32)
  assert np.abs(np.asarray(p).sum(-1) - 1).max() < 1e-6
  chex.assert_trees_all_close(p, p32, atol=1e-6)
  chex.assert_type(grads, jnp.bfloat16)
  chex.assert_tree_all_finite(grads)


# --- memory of the implicit mode -----------------------------------------------------------


def _residuals(mode, iters):
  """Shapes of everything jax.vjp keeps for the backward pass (traced only, not compiled)."""
  vjp_res = lambda x: jax.tree.leaves(jax.vjp(lambda y: sinkhorn(y, iters, mode), x)[1])
  res = jax.eval_shape(vjp_res, jax.ShapeDtypeStruct((3, 4, 4), jnp.float32))
  return sum(x.size * x.dtype.itemsize for x in res), [x.shape for x in res]


def test_implicit_memory_does_not_grow_with_iters():
  imp10, _ = _residuals("implicit", 10)
  imp200, shapes = _residuals("implicit", 200)
  assert imp10 == imp200 == 3 * 4 * 4 * 4, shapes  # only P is kept
  unr10, _ = _residuals("unroll", 10)
  unr200, unr_shapes = _residuals("unroll", 200)
  assert unr200 > 10 * unr10, (unr10, unr200)  # autodiff stores per-iteration values
  assert any(s[:1] == (200,) for s in unr_shapes), unr_shapes


def test_unroll_keeps_only_the_potentials():
  # The hand-written "unroll" gradient keeps f and g of each iteration ([iters, n] per matrix)
  # plus O(1) n x n arrays; autodiff through the loop kept every logsumexp's pieces (2.8x more).
  m, n = 3, 4
  for iters in (10, 200):
    size, shapes = _residuals("unroll", iters)
    floats = 2 * iters * n * m + 3 * n * n * m + 2 * n * m
    assert size <= 4 * floats, (iters, size, shapes)


# --- many matrices: the reductions written out ------------------------------------------------


def _reductions(jaxpr) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
  """(input shape, reduced axes) of every max / sum reduction in ``jaxpr`` and the jaxprs nested
  in its equations (loop bodies, custom gradients)."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("reduce_max", "reduce_sum"):
      out.append((eqn.invars[0].aval.shape, tuple(eqn.params["axes"])))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      out += _reductions(sub)
  return out


@pytest.mark.parametrize("mode", MODES)
def test_many_matrices_reduce_element_wise_and_match_the_reduction_form(mode):
  """From ``WRITTEN_FROM`` matrices on, the n x n projection's iterations (forward, and the
  unrolled backward) reduce over the short matrix axes element-wise (XLA's CPU reduction over
  them slowed down far faster than the matrix count: docs/results.md, "Sinkhorn gradient modes"), with
  the numbers of the reduction form, which smaller batches still use: the same matrices
  projected in two halves."""
  n = 4
  many = sk.WRITTEN_FROM
  z = _logits(11, (many, n, n), 2.0)
  w = _logits(12, (many, n, n))
  jaxpr = jax.make_jaxpr(lambda z: jax.vjp(lambda z: sinkhorn(z, 20, mode), z)[1](w))(z).jaxpr
  # none over a short axis of matrices laid out along the last axis ([n, n, N])
  leading = [(s, a) for s, a in _reductions(jaxpr) if s[-1] == many and len(s) - 1 not in a]
  assert not leading, leading
  half = many // 2
  both = jax.jit(lambda z: (_proj(z, iters=20, grad=mode), _grad(z, w, 20, mode)))
  p, g = both(z)
  p_lo, g_lo = _proj(z[:half], iters=20, grad=mode), _grad(z[:half], w[:half], 20, mode)
  p_hi, g_hi = _proj(z[half:], iters=20, grad=mode), _grad(z[half:], w[half:], 20, mode)
  np.testing.assert_allclose(p, np.concatenate([p_lo, p_hi]), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(g, np.concatenate([g_lo, g_hi]), rtol=1e-4, atol=1e-5)
