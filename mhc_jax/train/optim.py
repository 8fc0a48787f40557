"""The optimiser: learning-rate schedule, weight-decay mask, AdamW (+ clipping) from OptimConfig,
for unboxed parameters; the train step applies the non-finite policy (docs/interfaces.md).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from mhc_jax import parametrization as mp
from mhc_jax.train.config import ModelConfig, OptimConfig

__all__ = ["peak_lr", "make_schedule", "decay_mask", "decays", "make_optimizer"]

# Leaf names (last dict key on the path) that get weight decay; everything else does not.
_DECAY_NAMES = ("kernel", "embedding")
_DECAY_PREFIXES = ("w_", "phi")


def peak_lr(optim: OptimConfig, total_steps: int, lr: Any = None) -> Any:
  """`lr` (default optim.lr), tuned at optim.base_steps when set and then transferred to
  `total_steps`: ``lr (total_steps / base_steps)^-steps_exponent`` (docs/parametrization.md)."""
  lr = optim.lr if lr is None else lr
  if optim.base_steps is None:
    return lr
  return lr * (total_steps / optim.base_steps) ** -optim.steps_exponent


def make_schedule(optim: OptimConfig, total_steps: int, *, lr: Any = None) -> optax.Schedule:
  """Linear warm-up 0 -> lr over `optim.warmup_steps`, then to min_lr_ratio*lr at `total_steps`
  by a cosine or a straight line, or constant lr. Steps past the end hold the final value.

  `lr` overrides optim.lr and may be a traced array (a vmapped population of learning rates);
  either is the peak after :func:`peak_lr`. Value at step 0 is 0 when there is a warm-up.
  """
  peak = peak_lr(optim, total_steps, lr)
  warmup = int(optim.warmup_steps)
  decay_len = max(int(total_steps) - warmup, 1)
  end = optim.min_lr_ratio * peak
  kind = optim.schedule

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    t = jnp.clip((step - warmup) / decay_len, 0.0, 1.0)
    if kind == "cosine":
      after = end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * t))
    elif kind == "linear":
      after = peak + (end - peak) * t
    else:
      after = peak * jnp.ones_like(t)
    return after if warmup == 0 else jnp.where(step < warmup, peak * step / warmup, after)

  return schedule


def _leaf_name(path) -> str | None:
  """Last dict key on a pytree path (skips the `.value` attribute of flax metadata boxes)."""
  for k in reversed(path):
    if isinstance(k, jax.tree_util.DictKey):
      return str(k.key)
  return None


def decays(name: str | None) -> bool:
  """Whether a parameter with this leaf name gets weight decay: matrices and embeddings
  (`kernel`, `embedding`) and mixer dynamic weights (`w_*`, `phi*`). Not: norm `scale`,
  `bias`, mixer static parts (`b_*`), scalar gates (`alpha_*`, `s_*`), unnamed leaves."""
  return name is not None and (name in _DECAY_NAMES or name.startswith(_DECAY_PREFIXES))


def decay_mask(params) -> Any:
  """Pytree of bools with the structure of `params` (boxed or not): True = apply weight decay."""
  return jax.tree_util.tree_map_with_path(lambda path, _: decays(_leaf_name(path)), params)


def make_optimizer(
  optim: OptimConfig, total_steps: int, *, lr: Any = None, model: ModelConfig | None = None
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """(transformation, schedule) for `optim`.

  chain(clip_by_global_norm(clip) [off when clip is 0/None],
        AdamW(schedule, b1, b2, eps, weight_decay, mask=decay_mask)).

  independent_wd=False (optax/PyTorch AdamW):  p -= lr(t) * (adam + wd * p)
  independent_wd=True:                          p -= lr(t) * (adam + (wd/lr) * p)

  `lr` overrides optim.lr and may be a traced array (a population of learning rates); `lr` above
  is the peak, :func:`peak_lr`. `model.parametrization` mup/completep: per role, Adam with its
  eps, then its lr and weight-decay multipliers (mhc_jax.parametrization.scale_by_role); sp (or
  no model): the chain above.
  """
  wd = optim.weight_decay / (peak_lr(optim, total_steps, lr) if optim.independent_wd else 1.0)
  schedule = make_schedule(optim, total_steps, lr=lr)
  parts = []
  if optim.clip:
    parts.append(optax.clip_by_global_norm(optim.clip))
  if model is not None and model.parametrization != "sp":
    adam = dict(b1=optim.b1, b2=optim.b2, eps=optim.eps)
    parts += [mp.scale_by_role(model, adam, wd, decay_mask), optax.scale_by_learning_rate(schedule)]
  elif optim.independent_wd:
    parts += [
      optax.scale_by_adam(b1=optim.b1, b2=optim.b2, eps=optim.eps),
      optax.add_decayed_weights(wd, mask=decay_mask),
      optax.scale_by_learning_rate(schedule),
    ]
  else:
    parts.append(
      optax.adamw(
        schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=wd, mask=decay_mask
      )
    )
  return optax.chain(*parts), schedule
