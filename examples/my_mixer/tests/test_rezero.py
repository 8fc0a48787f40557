"""ReZero through mhc_jax's mixer contract, plus its own claim."""

import jax
import jax.numpy as jnp
from my_mixer.rezero import ReZero

from mhc_jax import testing


def test_contract():
  testing.check_mixer(ReZero)
  testing.check_mixer(ReZero, alpha_init=0.5)


def test_starts_as_the_identity():
  _, params, x, _, apply = testing.setup(ReZero)
  out, stats = apply(params, x)
  assert jnp.array_equal(out, x) and float(stats["h_post"][0]) == 0.0
  assert jax.tree.leaves(params)[0].shape == ()  # one scalar per layer
