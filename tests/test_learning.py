"""Learning checks: the project's train step drives a small Transformer's KL to the exact posterior
far below the uniform guess (bijection), and on HMM filtering below the guess that reads only the
header (smoke test: the model uses the observations).

The step is `train.step.make_train_step` jitted on one device (no mesh: the 8 simulated test
devices would only slow a model this small down); batches and metrics are the project's own.
Both tests train for hundreds of steps, so their train step and logits compile with XLA's
optimisations (without them each test takes twice as long); the session's other programs (the
data's and the metrics' eager ops, ~70 tiny ones) compile without, as everywhere in the suite.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mhc_jax import posterior
from mhc_jax.model import Transformer
from mhc_jax.testing import xla_optimizations
from mhc_jax.train import config as C
from mhc_jax.train.loop import prepare
from mhc_jax.train.optim import make_optimizer
from mhc_jax.train.state import State
from mhc_jax.train.step import make_train_step

KEYS = ("inputs", "targets", "mask", "posterior", "evidence")


def uniform_guess_kl(batch) -> float:
  """KL(posterior || uniform over the answer symbols), from the batch's own posterior."""
  p, mask = np.asarray(batch["posterior"]), np.asarray(batch["mask"])
  support = (p * mask[..., None]).reshape(-1, p.shape[-1]).max(0) > 0
  logits = np.broadcast_to(np.where(support, 0.0, -1e9).astype(np.float32), p.shape)
  return float(posterior.kl_bits(p, logits, mask))


def train_and_measure(overrides, eval_batches=4):
  """(KL before, KL after training, uniform-guess KL, {baseline: KL}) on validation batches."""
  cfg = C.load_config(
    None, ["data.target=posterior", "optim.weight_decay=0.0", "train.diag_every=0", *overrides]
  )
  setup = prepare(cfg)
  cfg, source = setup.cfg, setup.source
  model = Transformer(cfg.model)
  tx, sched = make_optimizer(cfg.optim, cfg.train.steps)

  @jax.jit  # one program: op by op, the scanned model's init took ~2 s
  def init(key):
    params = nn.meta.unbox(model.init(key, jnp.zeros((1, cfg.data.seq_len), jnp.int32)))
    zero = jnp.zeros((), jnp.int32)
    return State(step=zero, params=params, opt_state=tx.init(params), nonfinite=zero)

  state = init(jax.random.PRNGKey(cfg.train.seed))
  params = state.params
  val = [
    {k: v for k, v in source.batch(i, cfg.data.batch_size, "validation").items() if k in KEYS}
    for i in range(eval_batches)
  ]
  train_batch = lambda i: {
    k: v for k, v in source.batch(i, cfg.data.batch_size).items() if k in KEYS
  }
  with xla_optimizations(True):  # the two programs run a thousand times: as a run compiles them
    step = (
      jax.jit(make_train_step(model, tx, sched, cfg), static_argnums=2, donate_argnums=0)
      .lower(state, train_batch(0), False)
      .compile()
    )
    logits_fn = jax.jit(lambda p, x: model.apply(p, x)[0]).lower(params, val[0]["inputs"]).compile()

  def kl(params):
    return float(
      np.mean(
        [posterior.kl_bits(b["posterior"], logits_fn(params, b["inputs"]), b["mask"]) for b in val]
      )
    )

  kl0 = kl(state.params)
  base = {}
  if hasattr(source, "baselines"):
    from mhc_jax.evaluate import kl_bits_dist

    for b in val:
      for name, d in source.baselines(np.asarray(b["inputs"])).items():
        v = kl_bits_dist(np.asarray(b["posterior"]), d)
        base.setdefault(name, []).append(float((v * b["mask"]).sum() / b["mask"].sum()))
    base = {k: float(np.mean(v)) for k, v in base.items()}
  for i in range(cfg.train.steps):
    state, m = step(state, train_batch(i))
  assert int(state.nonfinite) == 0 and np.isfinite(float(m["loss"]))
  uni = float(np.mean([uniform_guess_kl(b) for b in val]))
  if base:
    assert base["uniform"] == pytest.approx(uni, rel=1e-4)
  return kl0, kl(state.params), uni, base


@pytest.mark.slow  # ~40 s on a free 2-core machine
def test_bijection_kl_falls_far_below_uniform_guess():
  kl0, kl1, uni, _ = train_and_measure(
    [
      "data.task=bijection",
      "data.options.n_symbols=6",
      "data.seq_len=32",
      "data.batch_size=64",
      "model.depth=2",
      "model.width=32",
      "model.heads=4",
      "optim.lr=5e-3",
      "optim.warmup_steps=20",
      "train.steps=1000",
    ]
  )
  print(f"bijection V=6: KL init {kl0:.3f}, trained {kl1:.3f}, uniform guess {uni:.3f} bits")
  assert uni > 1.0
  assert kl0 > 0.9 * uni  # untrained: no better than the uniform guess (worse: mass off the values)
  assert kl1 < 0.5 * uni


@pytest.mark.slow  # ~50 s on a free 2-core machine; 200 steps of a smaller model learn nothing
def test_hmm_filtering_kl_far_below_header_only_guess():
  """The model reads the observations, not just the header (the full run in
  docs/windtunnel_results.md also beats the last-observation guess)."""
  kl0, kl1, uni, base = train_and_measure(
    [
      "data.task=hmm",
      "data.options={n_states: 2, n_symbols: 3, stickiness: 0.7}",
      "data.seq_len=32",
      "data.batch_size=32",
      "model.depth=2",
      "model.width=64",
      "model.heads=4",
      "optim.lr=3e-3",
      "optim.warmup_steps=20",
      "train.steps=1000",
    ]
  )
  print(
    f"hmm filtering S=2 K=3: KL init {kl0:.3f}, trained {kl1:.3f}; baselines "
    + ", ".join(f"{k} {v:.3f}" for k, v in base.items())
  )
  assert base["header_only"] > 0.15  # the observations carry information the header does not
  assert kl1 < 0.5 * base["header_only"] and kl1 < kl0
