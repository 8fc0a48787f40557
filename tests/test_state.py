"""The train state's abstract shapes: traced once per model, not once per use."""

import jax
import jax.numpy as jnp
import numpy as np

from mhc_jax.model import Transformer
from mhc_jax.train import loop, state
from mhc_jax.train.config import load_config
from mhc_jax.train.loop import prepare
from mhc_jax.train.optim import make_optimizer

DEBUG = "configs/debug.yaml"


def counting_init(monkeypatch) -> list:
  """Record the width of every Transformer.init call (traced or not)."""
  calls, init = [], Transformer.init

  def counted(self, *a, **k):
    calls.append(self.cfg.width)
    return init(self, *a, **k)

  monkeypatch.setattr(Transformer, "init", counted)
  # both per-process memos start empty, whatever ran before in this worker
  monkeypatch.setattr(loop, "_SHAPES_CHECKED", set())
  state.param_shapes.cache_clear()
  return calls


def test_runs_that_share_a_model_trace_its_init_once(monkeypatch):
  calls = counting_init(monkeypatch)
  one = jax.devices()[:1]
  for lr in (1e-3, 1e-2, 1e-1):  # an lr grid: one model
    setup = prepare(load_config(DEBUG, [f"optim.lr={lr}", "mesh.data=1"]), devices=one)
  assert calls == [setup.cfg.model.width]
  wide = prepare(load_config(DEBUG, ["model.width=24", "mesh.data=1"]), devices=one)
  assert calls == [setup.cfg.model.width, 24]  # another model is traced, not served stale

  # the train loop's own uses (shardings, the restore target) hit the same entry
  cfg = wide.cfg
  model, tx = Transformer(cfg.model), make_optimizer(cfg.optim, cfg.train.steps)[0]
  tokens = jnp.zeros((1, cfg.data.seq_len), jnp.int32)
  shard = state.state_shardings(model, tokens, tx, wide.mesh)
  target = state.abstract_state(shard, model, tokens, tx)
  assert calls == [setup.cfg.model.width, 24]
  # and they are the shapes the state is really created with
  real = jax.tree.leaves(state.create_state(model, tokens, tx, wide.mesh, seed=0)[0].params)
  want = jax.tree.leaves(target.params)
  assert [a.shape for a in real] == [b.shape for b in want]
  assert all(np.dtype(a.dtype) == np.dtype(b.dtype) for a, b in zip(real, want))
