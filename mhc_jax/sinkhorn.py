"""Log-domain Sinkhorn-Knopp projection onto doubly stochastic matrices (mHC's `H_res`).

For logits `Z` (last two axes `n x n`, any leading shape) the projection is

    S(Z) = diag(a) exp(Z) diag(b),    S(Z) 1 = 1,   S(Z)^T 1 = 1,

computed in the log domain with potentials `f = log a`, `g = log b`. Each iteration normalises
the columns, then the rows:

    g_j <- -logsumexp_i (Z_ij + f_i),    f_i <- -logsumexp_j (Z_ij + g_j).

With a fixed iteration count the last step is a row step, so row sums are exact (to rounding) and
the truncation error sits in the column sums, as in the mHC paper. `stochastic_error` reports
both. Everything runs in (at least) float32: bf16 logits give a float32 result.

Gradients, chosen by `grad`:
- "unroll": autodiff through the iterations (memory grows with `iters`).
- "implicit": a custom VJP from the optimality conditions of the projection; only `P = S(Z)` is
  kept, so memory does not depend on `iters`. Differentiating `P_ij = exp(Z_ij + f_i + g_j)`
  subject to `P 1 = 1`, `P^T 1 = 1` gives, for an upstream cotangent `G`,

      dL/dZ = P * (G - alpha 1^T - 1 beta^T),
      A [alpha; beta] = [(P*G) 1; (P*G)^T 1],   A = [[diag(P 1), P], [P^T, diag(P^T 1)]].

  `A` is symmetric with null vector `v = [1; -1]` (the shift `alpha + c, beta - c`), and the right
  side is orthogonal to `v`. Solving with `A + v v^T` (nonsingular for positive `P`) returns the
  solution with `v . [alpha; beta] = 0`, exactly, in one batched dense solve of size `2n`. A ridge
  of 10 machine epsilons keeps it finite when entries of `P` underflow (logits spanning ~100);
  it costs about 1e-6 of gradient accuracy in float32.
  This is the gradient of the converged projection; it matches "unroll" as `iters` grows.
  Only reverse mode is defined for "implicit" (jax.grad / jacrev / vjp, not jvp / jacfwd).
"""

import functools
import numbers

import jax
import jax.numpy as jnp

GRAD_MODES = ("unroll", "implicit")
_RIDGE_EPS = 10.0  # ridge on the implicit system, in units of the dtype's machine epsilon


def _project(z: jax.Array, iters: int) -> jax.Array:
  """Runs `iters` column-then-row steps in the log domain; returns exp(z + f + g)."""

  def step(_, fg):
    f, _ = fg
    g = -jax.nn.logsumexp(z + f[..., :, None], axis=-2)  # columns
    f = -jax.nn.logsumexp(z + g[..., None, :], axis=-1)  # rows
    return f, g

  zeros = jnp.zeros(z.shape[:-1], z.dtype)
  f, g = jax.lax.fori_loop(0, iters, step, (zeros, zeros))
  return jnp.exp(z + f[..., :, None] + g[..., None, :])


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _project_implicit(z: jax.Array, iters: int) -> jax.Array:
  return _project(z, iters)


def _implicit_fwd(z, iters):
  p = _project(z, iters)
  return p, p


def _implicit_bwd(iters, p, g):
  del iters
  n = p.shape[-1]
  pg = p * g
  rhs = jnp.concatenate([pg.sum(-1), pg.sum(-2)], axis=-1)  # [..., 2n]
  # A = [[diag(P1), P], [P^T, diag(P^T 1)]] from the actual P, so v = [1; -1] is exactly null.
  eye = jnp.eye(n, dtype=p.dtype)
  a = jnp.concatenate(
    [
      jnp.concatenate([p.sum(-1)[..., None] * eye, p], axis=-1),
      jnp.concatenate([jnp.swapaxes(p, -1, -2), p.sum(-2)[..., None] * eye], axis=-1),
    ],
    axis=-2,
  )
  v = jnp.concatenate([jnp.ones(n, p.dtype), -jnp.ones(n, p.dtype)])
  # The ridge keeps the solve finite when entries of P underflow (very peaked logits).
  a = a + jnp.outer(v, v) + _RIDGE_EPS * jnp.finfo(p.dtype).eps * jnp.eye(2 * n, dtype=p.dtype)
  x = jnp.linalg.solve(a, rhs[..., None])[..., 0]
  alpha, beta = x[..., :n], x[..., n:]
  return (p * (g - alpha[..., :, None] - beta[..., None, :]),)


_project_implicit.defvjp(_implicit_fwd, _implicit_bwd)


def sinkhorn(logits: jax.Array, iters: int = 20, grad: str = "unroll") -> jax.Array:
  """Doubly stochastic projection of exp(logits) over the last two axes (float32 or wider).

  Args:
    logits: [..., n, n] real array, any dtype.
    iters: static number of column-then-row iterations (>= 1).
    grad: "unroll" (autodiff through the loop) or "implicit" (fixed-point custom VJP).
  """
  if grad not in GRAD_MODES:
    raise ValueError(f"grad must be one of {GRAD_MODES}, got {grad!r}")
  if isinstance(iters, bool) or not isinstance(iters, numbers.Integral) or iters < 1:
    raise ValueError(f"iters must be a static integer >= 1, got {iters!r}")
  logits = jnp.asarray(logits)
  if logits.ndim < 2 or logits.shape[-1] != logits.shape[-2]:
    raise ValueError(f"logits must be [..., n, n] (square last two axes), got shape {logits.shape}")
  z = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
  iters = int(iters)
  return _project_implicit(z, iters) if grad == "implicit" else _project(z, iters)


def stochastic_error(m: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(max |row sum - 1|, max |column sum - 1|) over all matrices in `m` [..., n, n], float32."""
  m = jnp.asarray(m, jnp.float32)
  row_err = jnp.max(jnp.abs(m.sum(-1) - 1.0))
  col_err = jnp.max(jnp.abs(m.sum(-2) - 1.0))
  return row_err, col_err
