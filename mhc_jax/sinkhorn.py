"""Log-domain Sinkhorn-Knopp projection onto doubly stochastic matrices (mHC's `H_res`).

Column-then-row steps on the potentials of ``diag(a) exp(Z) diag(b)``, ending on a row step (row
sums exact, the truncation error in the column sums), float32 inside; gradients ``"unroll"``
(exact for the truncated iteration) or ``"implicit"`` (custom VJP of the converged projection,
memory independent of ``iters``). The math: docs/interfaces.md, "The Sinkhorn projection".
"""

import functools
import numbers

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

GRAD_MODES = ("unroll", "implicit")
REMAT_NAME = "sinkhorn"  # names the output and residuals, for remat policies (model.remat=dots)
_RIDGE_EPS = 10.0  # ridge on the implicit system, in units of the dtype's machine epsilon


def _tokens_last(z: jax.Array) -> jax.Array:
  """``[..., n, n]`` -> ``[n, n, N]``: the N matrices along the last (contiguous) axis."""
  n = z.shape[-1]
  return jnp.moveaxis(z.reshape((-1, n, n)), 0, -1)


# Reductions over a short matrix axis (n <= UNROLL_N) of N >= WRITTEN_FROM matrices are written
# out over the n slices: faster on XLA's CPU there (docs/results.md, "Sinkhorn gradient modes").
UNROLL_N = 8
WRITTEN_FROM = 4096


def _slices(x: jax.Array, axis: int) -> list[jax.Array] | None:
  """The ``n`` slices of ``x [.., N]`` along a short ``axis`` when the reduction over it is
  written out (see above), else None."""
  n = x.shape[axis]
  if n > UNROLL_N or x.shape[-1] < WRITTEN_FROM:
    return None
  return [jax.lax.index_in_dim(x, i, axis, keepdims=False) for i in range(n)]


def _max(x: jax.Array, axis: int) -> jax.Array:
  parts = _slices(x, axis)
  return jnp.max(x, axis=axis) if parts is None else functools.reduce(jnp.maximum, parts)


def _sum(x: jax.Array, axis: int) -> jax.Array:
  parts = _slices(x, axis)
  return jnp.sum(x, axis=axis) if parts is None else functools.reduce(jnp.add, parts)


def _lse0(x: jax.Array) -> jax.Array:
  """logsumexp over axis 0 (the max shift guarded as in ``jax.nn.logsumexp``)."""
  m = _max(x, 0)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  return m + jnp.log(_sum(jnp.exp(x - m[None]), 0))


def _col(zt, f):
  """Column step: ``g_j = -logsumexp_i (Z_ij + f_i)``; ``zt [i, j, N]``, ``f [i, N]``."""
  return -_lse0(zt + f[:, None, :])


def _row(zt, g):
  """Row step: ``f_i = -logsumexp_j (Z_ij + g_j)``."""
  return -_lse0(jnp.swapaxes(zt, 0, 1) + g[:, None, :])


def _plan(zt, f, g):
  return jnp.exp(zt + f[:, None, :] + g[None, :, :])


def _back(pt, lead):
  return jnp.moveaxis(pt, -1, 0).reshape(lead + pt.shape[:2])


def _step(zt, f):
  """One column-then-row step from row potentials ``f``: ``(f after it, its g)``."""
  g = _col(zt, f)
  return _row(zt, g), g


def _potentials(zt, iters: int):
  zeros = jnp.zeros(zt.shape[1:], zt.dtype)
  return jax.lax.fori_loop(0, iters, lambda _, fg: _step(zt, fg[0]), (zeros, zeros))


def _project(z: jax.Array, iters: int) -> jax.Array:
  """Runs `iters` column-then-row steps in the log domain; returns exp(z + f + g)."""
  zt = _tokens_last(z)
  f, g = _potentials(zt, iters)
  return _back(_plan(zt, f, g), z.shape[:-2])


# "unroll": the gradient of the truncated iteration by hand, keeping only the potentials
# ([iters, n, N] each; docs/interfaces.md, "The Sinkhorn projection").
_project_unroll = jax.custom_vjp(_project, nondiff_argnums=(1,))


def _unroll_fwd(z, iters):
  zt = _tokens_last(z)

  def step(f, _):  # as _potentials, keeping each step's f (before it) and g
    f_new, g = _step(zt, f)
    return f_new, (f, g)

  f, (fs, gs) = jax.lax.scan(step, jnp.zeros(zt.shape[1:], zt.dtype), None, length=iters)
  pt = _plan(zt, f, gs[-1])
  zt, pt, f, fs, gs = (checkpoint_name(a, REMAT_NAME) for a in (zt, pt, f, fs, gs))
  return _back(pt, z.shape[:-2]), (zt, pt, f, fs, gs)


def _unroll_bwd(iters, res, gbar):
  zt, pt, f_last, fs, gs = res
  del iters
  w = pt * _tokens_last(gbar)  # P = exp(Z + f + g): dZ, df, dg of the last potentials
  f_next = jnp.concatenate([fs[1:], f_last[None]], axis=0)  # f after each step

  def step(carry, x):
    fbar, gbar_k, zbar = carry
    f_prev, g, f_new = x
    b = _plan(zt, f_new, g)  # row softmax of this step's row update, [i, j, N]
    zbar = zbar - b * fbar[:, None, :]
    gbar_k = gbar_k - _sum(b * fbar[:, None, :], 0)
    a = _plan(zt, f_prev, g)  # column softmax of its column update
    zbar = zbar - a * gbar_k[None, :, :]
    fbar = -_sum(a * gbar_k[None, :, :], 1)
    return (fbar, jnp.zeros_like(gbar_k), zbar), None

  init = (_sum(w, 1), _sum(w, 0), w)
  (_, _, zbar), _ = jax.lax.scan(step, init, (fs, gs, f_next), reverse=True)
  return (_back(zbar, gbar.shape[:-2]),)


_project_unroll.defvjp(_unroll_fwd, _unroll_bwd)


_project_implicit = jax.custom_vjp(_project, nondiff_argnums=(1,))


def _implicit_fwd(z, iters):
  p = checkpoint_name(_project(z, iters), REMAT_NAME)
  return p, p


def _implicit_bwd(iters, p, g):
  del iters
  n = p.shape[-1]
  pg = p * g
  rhs = jnp.concatenate([pg.sum(-1), pg.sum(-2)], axis=-1)  # [..., 2n]
  # A = [[diag(P1), P], [P^T, diag(P^T 1)]] from the actual P, so v = [1; -1] is exactly null.
  eye = jnp.eye(n, dtype=p.dtype)
  a = jnp.block(
    [[p.sum(-1)[..., None] * eye, p], [jnp.swapaxes(p, -1, -2), p.sum(-2)[..., None] * eye]]
  )
  v = jnp.concatenate([jnp.ones(n, p.dtype), -jnp.ones(n, p.dtype)])
  # The ridge keeps the solve finite when entries of P underflow (very peaked logits).
  a = a + jnp.outer(v, v) + _RIDGE_EPS * jnp.finfo(p.dtype).eps * jnp.eye(2 * n, dtype=p.dtype)
  x = jnp.linalg.solve(a, rhs[..., None])[..., 0]
  alpha, beta = x[..., :n], x[..., n:]
  return (p * (g - alpha[..., :, None] - beta[..., None, :]),)


_project_implicit.defvjp(_implicit_fwd, _implicit_bwd)


def sinkhorn(logits: jax.Array, iters: int = 20, grad: str = "unroll") -> jax.Array:
  """Doubly stochastic projection of exp(``logits [..., n, n]``, any dtype) over the last two
  axes (float32 or wider): ``iters`` (static, >= 1) column-then-row iterations, ``grad``
  "unroll" (through the loop) or "implicit" (fixed-point custom VJP)."""
  if grad not in GRAD_MODES:
    raise ValueError(f"grad must be one of {GRAD_MODES}, got {grad!r}")
  if isinstance(iters, bool) or not isinstance(iters, numbers.Integral) or iters < 1:
    raise ValueError(f"iters must be a static integer >= 1, got {iters!r}")
  logits = jnp.asarray(logits)
  if logits.ndim < 2 or logits.shape[-1] != logits.shape[-2]:
    raise ValueError(f"logits must be [..., n, n] (square last two axes), got shape {logits.shape}")
  z = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
  iters = int(iters)
  return _project_implicit(z, iters) if grad == "implicit" else _project_unroll(z, iters)


def stochastic_error(m: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(max |row sum - 1|, max |column sum - 1|) over all matrices in `m` [..., n, n], float32."""
  m = jnp.asarray(m, jnp.float32)
  row_err = jnp.max(jnp.abs(m.sum(-1) - 1.0))
  col_err = jnp.max(jnp.abs(m.sum(-2) - 1.0))
  return row_err, col_err
