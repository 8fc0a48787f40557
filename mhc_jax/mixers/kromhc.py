"""KromHC (Zhou et al., arXiv:2601.21579): ``H_res`` as a Kronecker product of small doubly
stochastic factors.

Layer: mHC's ``x' = H_res x + H_postᵀ F(H_pre x)`` (``mhc_jax/mixers/mhc.py``; same ``H_pre``,
``H_post``, the same ``v = RMSNorm(vec(x))`` and fused projection ``φ``) with

    n = i_1 · i_2 ⋯ i_K,      H_res = U_1 ⊗ U_2 ⊗ ⋯ ⊗ U_K,
    U_k = Σ_r a_{k,r} P^{(i_k)}_r,   a_k = softmax(α_res (v φ_res^k) + b_res^k),

where ``P^{(i)}_r`` are the ``i!`` permutation matrices of size ``i`` (Birkhoff-von Neumann, as in
mHC-lite, but per factor) and one scalar ``α_res`` is shared by all factors (as in the authors'
code). Each ``U_k`` is exactly doubly stochastic, and so is their Kronecker product
(``(A⊗B)1 = A1 ⊗ B1 = 1``, likewise for columns, entries stay non-negative): no Sinkhorn, no
truncation error (``sinkhorn_err = 0``). For ``n = 2^K`` with 2x2 factors each ``U_k`` is
``[[p, 1-p], [1-p, p]]`` and ``H_res`` needs ``2K`` logits instead of mHC's ``n²`` or mHC-lite's
``n!``. Stream index ``s = (s_1, ..., s_K)`` in row-major order (``s_1`` slowest), i.e. the state's
``n`` axis read as a tensor ``i_1 × ⋯ × i_K`` that each ``U_k`` mixes along its own mode.

Options, initialisation and state in detail: docs/mixers.md ("Mixer notes", ``kromhc``).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from mhc_jax.mixers.mhc import ManifoldHyperConnection
from mhc_jax.mixers.mhc_lite import permutation_matrices

MAX_FACTOR = 6  # 720 permutations per factor; beyond that a factor is not "small"


def default_factors(n: int) -> tuple[int, ...]:
  """``n`` as 2s and a remainder (``4 -> (2, 2)``, ``6 -> (2, 3)``, ``1 -> (1,)``)."""
  out = []
  while n % 2 == 0 and n > 1:
    out.append(2)
    n //= 2
  if n > 1 or not out:
    out.append(n)
  return tuple(out)


def parse_factors(spec: str, n: int) -> tuple[int, ...]:
  """``"2x2"`` -> ``(2, 2)``, checked against ``n``; ``""`` -> :func:`default_factors`."""
  if not spec:
    fs = default_factors(n)
  else:
    try:
      fs = tuple(int(s) for s in spec.lower().split("x"))
    except ValueError:
      raise ValueError(f"kromhc: factors must look like '2x2', got {spec!r}") from None
    if any(f < 1 for f in fs):
      raise ValueError(f"kromhc: factors must be positive, got {spec!r}")
    if math.prod(fs) != n:
      raise ValueError(f"kromhc: factors {spec!r} multiply to {math.prod(fs)}, not n={n}")
  if max(fs) > MAX_FACTOR:
    raise ValueError(
      f"kromhc: a factor of size {max(fs)} needs {math.factorial(max(fs))} "
      f"permutations; use factors <= {MAX_FACTOR} (e.g. factors='2x...')"
    )
  return fs


def kron(mats) -> jnp.ndarray:
  """Kronecker product of ``[..., a, a]`` matrices with shared leading (token) axes."""
  out = mats[0]
  for m in mats[1:]:
    a, b = out.shape[-1], m.shape[-1]
    out = (out[..., :, None, :, None] * m[..., None, :, None, :]).reshape(
      out.shape[:-2] + (a * b, a * b)
    )
  return out


class KromHC(ManifoldHyperConnection):
  factors: str = ""

  def factor_sizes(self) -> tuple[int, ...]:
    return parse_factors(self.factors, self.n)

  def res_size(self) -> int:
    return sum(math.factorial(f) for f in self.factor_sizes())

  def res_bias(self):
    fs = self.factor_sizes()
    if self.h_res_init == "uniform":
      return jnp.zeros((self.res_size(),), jnp.float32)
    if self.h_res_init != "identity":
      raise ValueError(
        f"kromhc: h_res_init must be 'identity' or 'uniform', got {self.h_res_init!r}"
      )
    q = self.res_diag ** (1.0 / len(fs))  # identity weight per factor; product over factors = 0.95
    parts = []
    for f in fs:
      k = math.factorial(f)
      z = np.zeros((k,), np.float32)
      if k > 1:
        z[0] = math.log(q / (1 - q) * (k - 1))
      parts.append(z)
    return jnp.asarray(np.concatenate(parts))

  def project_res(self, z_res):
    """``[..., Σ i_k!]`` logits -> ``U_1 ⊗ ⋯ ⊗ U_K`` ``[..., n, n]`` (exact, error 0)."""
    mats, start = [], 0
    for f in self.factor_sizes():
      k = math.factorial(f)
      # jax.nn.softmax shifts by a stop-gradient max: the gradient of jnp.max selects the
      # entries equal to the max, and XLA without optimisations (the test session's setting) can
      # recompute z with different rounding, find none, and divide 0 by 0 (NaN gradients).
      a = jax.nn.softmax(z_res[..., start : start + k], axis=-1)
      start += k
      mats.append(jnp.einsum("...r,rij->...ij", a, jnp.asarray(permutation_matrices(f))))
    return kron(mats), jnp.zeros((), jnp.float32)
