"""The train step: the loss (sampled targets, soft posterior targets, a wider model vocab) and
the per-layer gradient diagnostics."""

from pathlib import Path

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from mhc_jax.model import Transformer, state_shapes, zero_probes
from mhc_jax.train.config import load_config
from mhc_jax.train.optim import make_optimizer
from mhc_jax.train.state import State
from mhc_jax.train.step import fit_posterior, make_loss, make_train_step, token_loss

ROOT = Path(__file__).resolve().parents[1]


def test_posterior_loss_with_model_vocab_wider_than_data():
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  post = jax.nn.softmax(jax.random.normal(k1, (2, 3, 10)))
  logits = jax.random.normal(k2, (2, 3, 16))
  batch = {"posterior": post, "mask": jnp.ones((2, 3)), "targets": jnp.zeros((2, 3), jnp.int32)}
  loss, _ = token_loss(logits, batch, "posterior")
  want = -np.mean(np.sum(np.asarray(post) * np.asarray(jax.nn.log_softmax(logits))[..., :10], -1))
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  assert fit_posterior(batch, 16)["posterior"].shape == (2, 3, 16)
  assert fit_posterior(batch, 10) is batch


def _tiny_step(mixer: str, opts: str):
  """(model, cfg, batch, step, state) for configs/debug.yaml's model (depth 1, width 16)."""
  cfg = load_config(
    ROOT / "configs" / "debug.yaml",
    [f"model.mixer={mixer}", f"model.mixer_options={opts}", "model.vocab=32"],
  )
  model = Transformer(cfg.model)
  b, t = cfg.data.batch_size, cfg.data.seq_len
  tokens = jax.random.randint(jax.random.PRNGKey(1), (b, t + 1), 0, cfg.model.vocab)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": jnp.ones((b, t))}
  params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), batch["inputs"]))
  tx, schedule = make_optimizer(cfg.optim, 10)
  state = State(jnp.zeros((), jnp.int32), params, tx.init(params), jnp.zeros((), jnp.int32))
  return model, cfg, batch, make_train_step(model, tx, schedule, cfg), state


MIXERS = [("mhc", "{n: 4}"), ("value_residual", "{}")]  # an array state, a pytree state


@pytest.mark.parametrize("mixer,opts", MIXERS)
def test_diag_grad_rms_is_the_rms_of_dloss_dstate(mixer, opts):
  """The step's per-layer ``grad_rms`` (from squared-norm taps) and the RMS of dLoss/d(state)
  from full zero probes (autodiff), for array and pytree states."""
  model, cfg, batch, step, state = _tiny_step(mixer, opts)
  b, t = batch["inputs"].shape
  _, metrics = jax.jit(step, static_argnums=2)(state, batch, True)
  loss = make_loss(model, cfg)
  g_layers, g_out = jax.jit(jax.grad(lambda p: loss(state.params, p, batch)[0]))(
    zero_probes(cfg.model, b, t)
  )
  L2 = 2 * cfg.model.depth
  leaves = [g.reshape(L2, -1) for g in jax.tree.leaves(g_layers)]
  want = np.sqrt(sum(np.sum(np.square(g), 1) for g in leaves) / sum(g.shape[1] for g in leaves))
  assert np.all(want > 0)
  np.testing.assert_allclose(metrics["grad_rms"], want, rtol=1e-5)
  out = jax.tree.leaves(g_out)
  want_out = np.sqrt(sum(np.sum(np.square(g)) for g in out) / sum(g.size for g in out))
  np.testing.assert_allclose(metrics["gain_bwd"][-1], metrics["grad_rms"][-1] / want_out, rtol=1e-5)


def test_diag_step_keeps_no_buffer_of_every_layers_state():
  """The diagnostics step holds no ``[L, 2, *state]`` array (the gradients of full zero probes):
  with n = 4 streams that is 2L copies of the whole stream state, written and reduced every
  diagnostics step."""
  model, cfg, batch, step, state = _tiny_step("mhc", "{n: 4}")
  b, t = batch["inputs"].shape
  full = (cfg.model.depth, 2) + state_shapes(cfg.model, b, t).shape

  def shapes(jaxpr):
    for eqn in jaxpr.eqns:
      for v in eqn.outvars:
        yield tuple(getattr(v.aval, "shape", ()))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        yield from shapes(sub)

  jaxpr = jax.make_jaxpr(step, static_argnums=2)(state, batch, True).jaxpr
  seen = set(shapes(jaxpr))
  assert full[2:] in seen  # the walk does see the state itself
  assert full not in seen
