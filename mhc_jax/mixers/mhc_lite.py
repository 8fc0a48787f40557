"""mHC-lite (arXiv:2601.05732): ``H_res`` as a convex mix of the n! permutation matrices.

``H_res = Σ_k a_k P_k`` with ``a = softmax(α (v W) + b)``: exactly doubly stochastic with no
iterative projection (24 terms at n = 4). ``h_res_init="identity"`` puts weight 0.95 on the
identity permutation; ``"uniform"`` (b = 0) gives exactly ``J/n``. Everything else is mHC.
"""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

from mhc_jax.mixers.mhc import ManifoldHyperConnection

MAX_N = 6  # 720 permutations; beyond that the mix is too large to be "lite"


def permutation_matrices(n: int) -> np.ndarray:
  """All n! permutation matrices ``[n!, n, n]``, the identity first."""
  eye = np.eye(n, dtype=np.float32)
  return np.stack([eye[list(p)] for p in itertools.permutations(range(n))])


class MHCLite(ManifoldHyperConnection):
  def res_size(self) -> int:
    if self.n > MAX_N:
      raise ValueError(
        f"mhc_lite: n={self.n} needs {math.factorial(self.n)} permutations; "
        f"use n <= {MAX_N} or mixer 'mhc'"
      )
    return math.factorial(self.n)

  def res_bias(self):
    k = self.res_size()
    if self.h_res_init == "uniform" or k == 1:
      return jnp.zeros((k,), jnp.float32)
    if self.h_res_init == "identity":
      gap = math.log(self.res_diag / (1 - self.res_diag) * (k - 1))
      return jnp.zeros((k,), jnp.float32).at[0].set(gap)
    raise ValueError(
      f"mhc_lite: h_res_init must be 'identity' or 'uniform', got {self.h_res_init!r}"
    )

  def project_res(self, z_res):
    # jax.nn.softmax, not exp(z - max(z)): the gradient of jnp.max divides by the count of
    # entries equal to the max, which unoptimised XLA can recompute as 0 (NaN gradients).
    a = jax.nn.softmax(z_res, axis=-1)
    h = jnp.einsum("...k,kij->...ij", a, jnp.asarray(permutation_matrices(self.n)))
    return h, jnp.zeros((), jnp.float32)
