"""The Transformer: scan == loop, remat-invariance, causality, mixer swaps, probes, param counts.

Tolerances: float32 throughout; scan/loop and remat differ only by op ordering (atol 1e-5);
HC-at-init vs residual differ by the final RMSNorm's eps acting on n·h vs h (atol 1e-4).
"""

import dataclasses
import functools
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mhc_jax.model import (
  Transformer,
  count_params,
  expected_params,
  loop_to_scan,
  probe_shape,
  scan_to_loop,
)
from mhc_jax.model.params import MIXER_KEYS
from mhc_jax.train.config import ModelConfig

B, T, V = 2, 8, 32
TOKENS = jax.random.randint(jax.random.PRNGKey(1), (B, T), 0, V)


def cfg_for(mixer="mhc", **kw):
  opts = kw.pop("mixer_options", {} if mixer == "residual" else {"n": 4})
  return ModelConfig(vocab=V, depth=2, width=16, heads=2, mixer=mixer, mixer_options=opts, **kw)


@functools.lru_cache(maxsize=None)
def init(cfg, seed=0):
  f = jax.jit(lambda k: nn.meta.unbox(Transformer(cfg).init(k, TOKENS)))
  return f(jax.random.PRNGKey(seed))


def vg(f, **kw):
  return jax.jit(jax.value_and_grad(f, **kw))


def loss_fn(cfg):
  model = Transformer(cfg)

  def loss(params, probes=None):
    logits, _ = model.apply(params, TOKENS, probes)
    return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

  return loss


@pytest.mark.parametrize("mixer", ["residual", "mhc"])
def test_scan_equals_loop(mixer):
  cfg = cfg_for(mixer)
  p_scan = init(cfg)
  loop_cfg = dataclasses.replace(cfg, scan=False)
  p_loop = {"params": scan_to_loop(p_scan["params"], cfg.depth)}
  assert jax.tree.structure(init(loop_cfg)) == jax.tree.structure(p_loop)
  l_s, g_s = vg(loss_fn(cfg))(p_scan)
  l_l, g_l = vg(loss_fn(loop_cfg))(p_loop)
  np.testing.assert_allclose(l_s, l_l, rtol=1e-6)
  g_l = {"params": loop_to_scan(g_l["params"], cfg.depth)}
  chex.assert_trees_all_close(g_s, g_l, atol=1e-5, rtol=1e-5)


def test_remat_does_not_change_results():
  cfg = cfg_for("mhc")
  params = init(cfg)
  l0, g0 = vg(loss_fn(cfg))(params)
  for remat in ("full", "dots"):
    l1, g1 = vg(loss_fn(dataclasses.replace(cfg, remat=remat)))(params)
    np.testing.assert_allclose(l0, l1, rtol=1e-6)
    chex.assert_trees_all_close(g0, g1, atol=1e-5, rtol=1e-5)


def _rematted_sinkhorn_loops(cfg, params) -> int:
  """Sinkhorn loops (mhc's project_res) run again in the backward's rematerialised forward."""
  hlo = vg(loss_fn(cfg)).lower(params).compile().as_text()
  return len(re.findall(r" while\(.*rematted_computation.*project_res", hlo))


def test_remat_dots_keeps_the_sinkhorn_results():
  """model.remat=dots saves the projection's output and potentials (sinkhorn.REMAT_NAME): the
  rematerialised forward runs no Sinkhorn iterations (remat=full still does: the count can fail)."""
  cfg = cfg_for("mhc")
  params = init(cfg)
  assert _rematted_sinkhorn_loops(dataclasses.replace(cfg, remat="full"), params) > 0
  assert _rematted_sinkhorn_loops(dataclasses.replace(cfg, remat="dots"), params) == 0


def test_causal():
  """d logits[t] / d(stream at position s) is zero for every s > t (gradients through probes).
  mhc: its per-token dynamic coefficients must not leak across time either."""
  cfg = cfg_for("mhc")
  params, model = init(cfg), Transformer(cfg)
  probes = jnp.zeros(probe_shape(cfg, B, T))

  def out_at(probes, t):
    return jnp.sum(model.apply(params, TOKENS, probes)[0][:, t])

  grad = jax.jit(jax.grad(out_at), static_argnums=1)
  for t in (0, 3, T - 2):
    g = grad(probes, t)  # [L, 2, B, T, n, C]
    assert float(jnp.abs(g[:, :, :, t + 1 :]).max()) == 0.0
    assert float(jnp.abs(g[:, :, :, : t + 1]).max()) > 0.0


def test_swapping_mixer_touches_only_mixer_params():
  def non_mixer(p):
    flat = jax.tree_util.tree_leaves_with_path(p)
    return {
      jax.tree_util.keystr(k): v.shape
      for k, v in flat
      if not any(getattr(e, "key", None) in MIXER_KEYS for e in k)
    }

  base = non_mixer(init(cfg_for("residual")))
  for mixer in ("hc", "mhc", "mhc_lite"):
    assert non_mixer(init(cfg_for(mixer))) == base


def _copy_non_mixer(src, dst):
  def pick(path, d):
    if any(getattr(e, "key", None) in MIXER_KEYS for e in path):
      return d
    node = src
    for e in path:
      node = node[e.key]
    return node

  return jax.tree_util.tree_map_with_path(pick, dst)


@pytest.mark.parametrize("dynamic", [False, True])
def test_hc_at_init_equals_residual_model(dynamic):
  res_cfg = cfg_for("residual")
  hc_cfg = cfg_for("hc", mixer_options={"n": 4, "dynamic": dynamic})
  p_res = init(res_cfg)
  p_hc = _copy_non_mixer(p_res, init(hc_cfg, seed=5))
  l_res, _ = jax.jit(Transformer(res_cfg).apply)(p_res, TOKENS)
  l_hc, aux = jax.jit(Transformer(hc_cfg).apply)(p_hc, TOKENS)
  chex.assert_trees_all_close(l_hc, l_res, atol=1e-4)
  assert aux["stats"]["h_res"].shape == (4, 4, 4)


def test_probe_gradient_is_dloss_dstream():
  """At layer 0 of a residual model the stream is the embedding lookup: its gradient,
  scattered back onto the vocabulary, must equal the embedding-table gradient (untied head)."""
  cfg = cfg_for("residual", tied_embeddings=False)
  params, loss = init(cfg), loss_fn(cfg)
  probes = jnp.zeros(probe_shape(cfg, B, T))
  g_params, g_probes = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, probes)
  g_stream = g_probes[0, 0, :, :, 0, :]  # [B, T, C] entering layer 0
  scattered = jnp.zeros((V, cfg.width)).at[TOKENS].add(g_stream)
  chex.assert_trees_all_close(scattered, g_params["params"]["embedding"], atol=1e-7)
  # A second way for a deep layer: the directional derivative by finite differences.
  direction = jax.random.normal(jax.random.PRNGKey(2), probes.shape)
  eps = 1e-2
  loss = jax.jit(loss)
  fd = (loss(params, eps * direction) - loss(params, -eps * direction)) / (2 * eps)
  np.testing.assert_allclose(fd, jnp.vdot(g_probes, direction), rtol=2e-2)


@pytest.mark.parametrize(
  "mixer,opts,extra",
  [
    ("residual", {}, {}),
    ("hc", {"n": 4}, {}),
    ("hc", {"n": 2, "dynamic": False}, {"tied_embeddings": False}),
    ("mhc", {"n": 4}, {"qk_norm": True}),
    ("mhc", {"n": 3, "dynamic": False, "collapse": "learned"}, {}),
    ("mhc_lite", {"n": 3}, {"mlp_ratio": 2.0}),
  ],
)
def test_param_counts_match_closed_form(mixer, opts, extra):
  cfg = cfg_for(mixer, mixer_options=opts, **extra)
  assert count_params(init(cfg)) == expected_params(cfg)


def test_aux_outputs_and_bf16():
  cfg = cfg_for("mhc", dtype="bfloat16")
  params = init(cfg)
  logits, aux = jax.jit(Transformer(cfg).apply)(params, TOKENS)
  assert logits.dtype == jnp.float32
  assert aux["stats"]["rms_in"].shape == (2 * cfg.depth,)
  assert aux["attn_logit_max"].shape == (cfg.depth,)
  np.testing.assert_allclose(aux["out_logit_max"], logits.max(), rtol=1e-6)
  chex.assert_tree_all_finite(jax.jit(jax.grad(loss_fn(cfg)))(params))


def test_original_mixers_unchanged_by_the_contract_move():
  """residual / hc / mhc / mhc_lite under the generalised contract give the outputs they gave
  before it (tests/data/mixers_before_contract.npz, written by the pre-contract model)."""
  import pathlib

  gold = np.load(pathlib.Path(__file__).parent / "data" / "mixers_before_contract.npz")
  old = {"stream_init": "symmetric", "res_diag": 0.95}  # mHC's initialisation then
  cases = {
    "residual": {},
    "hc": {"n": 4},
    "hc_static": {"n": 4, "dynamic": False},
    "mhc": {"n": 4, **old},
    "mhc_uniform": {"n": 4, "h_res_init": "uniform", **old},
    "mhc_lite": {"n": 3, **old},
    "mhc_learned": {"n": 2, "collapse": "learned", **old},
  }
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 8), 0, 11)
  for key, opts in cases.items():
    mixer = "mhc_lite" if key == "mhc_lite" else key.split("_")[0]
    cfg = ModelConfig(vocab=11, depth=2, width=16, heads=2, mixer=mixer, mixer_options=opts)
    m = Transformer(cfg)
    params = nn.meta.unbox(jax.jit(m.init)(jax.random.PRNGKey(0), tokens))

    def loss(p):
      out = m.apply(p, tokens)  # traced once: tracing and compiling are most of this test
      return jnp.mean(out[0] ** 2), out

    @jax.jit  # one program per case: the outputs and the gradient
    def outputs(p):
      (_, (logits, aux)), g = jax.value_and_grad(loss, has_aux=True)(p)
      return logits, aux, g

    logits, aux, g = outputs(params)
    got = {
      "logits": logits,
      "h_res": aux["stats"]["h_res"],
      "rms_out": aux["stats"]["rms_out"],
      "grad_embedding": g["params"]["embedding"],
    }
    for k, v in got.items():
      np.testing.assert_allclose(
        np.asarray(v), gold[f"{key}/{k}"], rtol=1e-6, atol=1e-6, err_msg=f"{key}/{k}"
      )


@pytest.mark.parametrize("scan", [True, False])
def test_stats_off_computes_no_layer_stats_and_same_logits(scan, optimized):
  """``stats=False`` (the train step without diagnostics) returns the same logits and leaves
  the per-layer mixer stats out, so XLA does not compute and stack them under the scan.
  Bit-equal logits as compiled for a run (``optimized``): without optimisations XLA computes
  the two programs' shared ops with different roundings."""
  cfg = cfg_for("mhc", scan=scan)
  params = init(cfg)
  model = Transformer(cfg)
  logits_on, aux_on = jax.jit(model.apply)(params, TOKENS)
  logits_off, aux_off = jax.jit(functools.partial(model.apply, stats=False))(params, TOKENS)
  np.testing.assert_array_equal(logits_on, logits_off)
  assert "stats" in aux_on and "stats" not in aux_off and "attn_logit_max" not in aux_off
  if scan:  # the scan stacks nothing per layer: its only output is the carried state
    jaxpr = jax.make_jaxpr(functools.partial(model.apply, stats=False))(params, TOKENS)
    n_out = [len(e.outvars) for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert n_out and max(n_out) == 1, n_out
