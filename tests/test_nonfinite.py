"""Where a run broke: a NaN planted in one layer's parameters is located at that mixer layer and
tensor (the ``nonfinite`` event's ``layer``/``tensor``, summary.json's ``first_nonfinite``), for a
single run and for a population; and the update-to-parameter ratio per block against SGD's."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from faults import NanAt

from mhc_jax import logs, rundir
from mhc_jax.train.config import load_config
from mhc_jax.train.loop import SingleProgram, prepare, run_members

ROOT = Path(__file__).resolve().parents[1]


def _cfg(*extra):
  """Depth 3 (mixer layers 0..5); diagnostics every 10 steps, so the bad steps are not diag
  steps: the location does not wait for one."""
  return load_config(
    ROOT / "configs" / "debug.yaml",
    [
      "model.depth=3",
      "train.steps=2",
      "train.diag_every=10",
      "train.eval_every=0",
      "mesh.data=1",
      *extra,
    ],
  )


def _poison(params, block: int, sub: str):
  """``params`` with NaN in block ``block``'s ``sub`` (attn | mlp) output projection."""
  leaf = {"attn": ("attn", "out"), "mlp": ("mlp", "down")}[sub]
  blocks = params["params"]["blocks"]
  w = blocks[leaf[0]][leaf[1]]["kernel"]
  blocks[leaf[0]][leaf[1]]["kernel"] = w.at[block].set(jnp.nan)
  return params


class Poisoned(SingleProgram):
  def __init__(self, setup, block, sub):
    super().__init__(setup)
    self.where = (block, sub)

  def init(self):
    state = super().init()
    return state.replace(params=_poison(jax.tree.map(jnp.copy, state.params), *self.where))


@pytest.mark.parametrize("block,sub,layer", [(1, "mlp", 3), (2, "attn", 4)])
def test_a_nan_planted_in_one_layer_is_located_there(tmp_path, block, sub, layer):
  cfg = _cfg()
  run = tmp_path / "run"
  (summary,) = run_members(
    Poisoned(prepare(cfg, devices=jax.devices()[:1]), block, sub),
    [cfg], [run], resume=False, progress=False,
  )  # fmt: skip
  # the stream entering the layer is finite, the sublayer's output is the first NaN
  where = {"layer": layer, "tensor": "branch"}
  assert summary["nonfinite"] == 2 and summary["first_nonfinite"] == {"step": 0, **where}
  assert rundir.read_summary(run)["first_nonfinite"] == {"step": 0, **where}
  events = [e for e in logs.read_jsonl(run / "events.jsonl") if e["kind"] == "nonfinite"]
  assert [(e["step"], e["layer"], e["tensor"]) for e in events] == [(0, layer, "branch")] * 1 + [
    (1, layer, "branch")
  ]


def test_a_nan_loss_with_finite_layers_is_the_loss_and_diag_off_is_not_located(tmp_path):
  """faults.NanAt makes the mask NaN at step 1: every layer and the logits are finite."""
  for diag, want in ((10, {"layer": None, "tensor": "loss"}), (0, {"layer": None, "tensor": None})):
    cfg = _cfg(f"train.diag_every={diag}")
    setup = prepare(cfg, devices=jax.devices()[:1])
    setup = dataclasses.replace(setup, source=NanAt(setup.source, 1))
    run = tmp_path / f"diag{diag}"
    (summary,) = run_members(SingleProgram(setup), [cfg], [run], resume=False, progress=False)
    assert summary["first_nonfinite"] == {"step": 1, **want}
    (event,) = [e for e in logs.read_jsonl(run / "events.jsonl") if e["kind"] == "nonfinite"]
    assert {k: event[k] for k in ("layer", "tensor")} == want


@pytest.mark.slow
def test_population_locates_each_failing_member(tmp_path):
  from mhc_jax.sweep.population import PopulationProgram

  cfgs = [_cfg(f"optim.lr={lr}") for lr in (1e-3, 2e-3)]
  setups = [prepare(c, devices=jax.devices()[:1]) for c in cfgs]

  class Pop(PopulationProgram):
    def init(self):  # member 1 poisoned at block 0's MLP (mixer layer 1)
      state = super().init()
      w = state.params["params"]["blocks"]["mlp"]["down"]["kernel"]
      params = jax.tree.map(jnp.copy, state.params)
      params["params"]["blocks"]["mlp"]["down"]["kernel"] = w.at[1, 0].set(jnp.nan)
      return state.replace(params=params)

  runs = [tmp_path / "a", tmp_path / "b"]
  good, bad = run_members(Pop(setups), cfgs, runs, resume=False, progress=False)
  assert good["nonfinite"] == 0 and good["first_nonfinite"] is None
  assert bad["first_nonfinite"] == {"step": 0, "layer": 1, "tensor": "branch"}


def test_update_ratio_is_lr_times_grad_over_param_norm_under_sgd():
  """Plain SGD: the update is -lr * g, so per block RMS(update)/RMS(params) = lr |g_b| / |p_b|."""
  from mhc_jax.diagnostics import tree_layer_norms
  from mhc_jax.model import Transformer
  from mhc_jax.train.state import State
  from mhc_jax.train.step import make_train_step

  cfg = _cfg("model.depth=2", "model.vocab=32")
  model = Transformer(cfg.model)
  b, t, lr = cfg.data.batch_size, cfg.data.seq_len, 0.05
  tokens = jax.random.randint(jax.random.PRNGKey(1), (b, t + 1), 0, cfg.model.vocab)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": jnp.ones((b, t))}
  import flax.linen as nn

  params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), batch["inputs"]))
  tx = optax.sgd(lr)
  state = State(jnp.zeros((), jnp.int32), params, tx.init(params), jnp.zeros((), jnp.int32))
  step = jax.jit(make_train_step(model, tx, lambda s: lr, cfg), static_argnums=2)
  _, m = step(state, batch, True)
  want = lr * np.asarray(m["layer_grad_norm"]) / tree_layer_norms(params["params"]["blocks"])
  assert m["update_ratio"].shape == (2,) and not math.isclose(want[0], want[1], rel_tol=1e-3)
  np.testing.assert_allclose(m["update_ratio"], want, rtol=1e-5)


def test_a_diagnostics_step_locates_from_its_own_stats_without_a_second_pass():
  """A diagnostics step already has every per-layer stat the location reads, so it locates
  without the re-run a plain step needs: its program holds one forward and backward, as many
  dots as the same step built without localisation, and still returns ``nonfinite_at``."""
  from mhc_jax.model import Transformer
  from mhc_jax.train.optim import make_optimizer
  from mhc_jax.train.state import init_fn
  from mhc_jax.train.step import make_train_step

  cfg = _cfg("model.vocab=32")
  model = Transformer(cfg.model)
  tx, schedule = make_optimizer(cfg.optim, cfg.train.steps)
  b, t = cfg.data.batch_size, cfg.data.seq_len
  state = init_fn(model, jnp.zeros((1, t), jnp.int32), tx)(jax.random.PRNGKey(0))
  batch = {"inputs": jnp.zeros((b, t), jnp.int32), "targets": jnp.zeros((b, t), jnp.int32),
           "mask": jnp.ones((b, t))}  # fmt: skip

  def dots(locate: bool, diag: bool) -> tuple[int, dict]:
    step = jax.jit(make_train_step(model, tx, schedule, cfg, locate=locate), static_argnums=2)
    text = step.lower(state, batch, diag).as_text()
    return text.count("stablehlo.dot_general"), jax.eval_shape(step, state, batch, diag)[1]

  (with_loc, out), (without, _) = dots(True, True), dots(False, True)
  assert with_loc == without and out["nonfinite_at"].shape == (2,)
  plain_loc, plain = dots(True, False)[0], dots(False, False)[0]
  assert plain_loc > plain  # a plain step re-runs forward and backward, only when it went bad
