"""The pure, jitted train and eval steps: ``train_step(state, batch, diag) -> (state, metrics)``
(loss, optax update, non-finite skip, the metrics of docs/interfaces.md) and ``evaluate``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mhc_jax import diagnostics as dg, posterior
from mhc_jax.model import state_shapes, zero_probes
from mhc_jax.train.state import State


def fit_posterior(batch: dict, vocab: int) -> dict:
  """Zero-pad the exact posterior to the model's vocabulary (model.vocab may exceed the data's)."""
  if "posterior" not in batch or batch["posterior"].shape[-1] == vocab:
    return batch
  post = batch["posterior"]
  pad = [(0, 0)] * (post.ndim - 1) + [(0, vocab - post.shape[-1])]
  return batch | {"posterior": jnp.pad(post, pad)}


def token_loss(logits, batch, target: str):
  """Mean cross-entropy over masked positions (sampled target, or the exact posterior)."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  if target == "posterior":
    ce = -jnp.sum(fit_posterior(batch, logits.shape[-1])["posterior"] * logp, axis=-1)
  else:
    ce = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
  mask = batch["mask"].astype(jnp.float32)
  denom = jnp.maximum(mask.sum(), 1.0)
  z = jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)) * mask) / denom
  return jnp.sum(ce * mask) / denom, z


def make_loss(model, cfg):
  def loss_fn(params, probes, batch):
    layer_probes, out_probe = probes if probes is not None else (None, None)
    # without probes (diagnostics off) the per-layer stats are not computed at all
    logits, aux = model.apply(
      params, batch["inputs"], layer_probes, out_probe, stats=probes is not None
    )
    loss, z = token_loss(logits, batch, cfg.data.target)
    total = loss + cfg.train.z_loss * z
    return total, (loss, z, aux)

  return loss_fn


#: What :func:`locate_nonfinite` can name, in the order the step computes them.
NONFINITE_TENSORS = ("stream_in", "branch", "stream_out", "logits", "loss", "grad_stream", "grads")


def locate_nonfinite(loss_fn, cfg, params, batch) -> jax.Array:
  """``[layer, tensor]`` of the first non-finite value in the order the step computes them
  (docs/interfaces.md, "Metrics records"); ``tensor`` indexes :data:`NONFINITE_TENSORS`, -1 for
  none (``layer``: -1 for none or not per layer). Re-runs forward and backward with the
  per-layer stats: what a step without diagnostics needs (a diagnostics step has them)."""
  b, t = batch["inputs"].shape
  probes = zero_probes(cfg.model, b, t, squares=True)
  (_, (loss, _, aux)), (grads, (sq_layers, _)) = jax.value_and_grad(
    loss_fn, argnums=(0, 1), has_aux=True
  )(params, probes, batch)
  return nonfinite_where(aux, sq_layers, loss, grads)


def nonfinite_where(aux, sq_layers, loss, grads) -> jax.Array:
  """:func:`locate_nonfinite` from a pass's stats: ``aux`` (the model's, with stats),
  ``sq_layers`` (the squared-gradient probes of the layers), the loss and the gradients."""
  s = aux["stats"]
  fwd = jnp.stack([s["rms_in"], s["branch_rms"], s["rms_out"]], axis=1)  # [2L, 3]
  L2 = fwd.shape[0]
  grad_sq = sum(g.reshape(L2) for g in jax.tree.leaves(sq_layers))[::-1]  # from the output back
  logits = jnp.stack([aux["out_logit_max"], aux["logsumexp_max"]])
  bad = ~jnp.isfinite(
    jnp.concatenate([fwd.reshape(-1), logits, loss[None], grad_sq, optax.tree.norm(grads)[None]])
  )
  layer = np.r_[np.repeat(np.arange(L2), 3), -1, -1, -1, np.arange(L2)[::-1], -1]
  tensor = np.r_[np.tile([0, 1, 2], L2), 3, 3, 4, np.full(L2, 5), 6]
  at = jnp.asarray(np.stack([layer, tensor], 1), jnp.int32)[jnp.argmax(bad)]
  return jnp.where(bad.any(), at, -1)


def make_train_step(model, tx, schedule, cfg, locate: bool = True):
  loss_fn = make_loss(model, cfg)
  clip = cfg.optim.clip or 0.0

  def step(state: State, batch: dict, diag: bool):
    b, t = batch["inputs"].shape
    probes = zero_probes(cfg.model, b, t, squares=True) if diag else None
    (total, (loss, z, aux)), (grads, g_probe) = jax.value_and_grad(
      loss_fn, argnums=(0, 1), has_aux=True
    )(state.params, probes, batch)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(total) & jnp.isfinite(grad_norm)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    # the lr of this update: optax's schedule counts the updates applied, not the steps taken
    lr = schedule(state.step - state.nonfinite)
    new = State(
      step=state.step + 1,
      params=keep(params, state.params),
      opt_state=keep(opt_state, state.opt_state),
      nonfinite=state.nonfinite + (~finite).astype(jnp.int32),
    )
    upd_rms = dg.tree_rms(updates)
    metrics = {"loss": loss, "z_loss": z, "lr": lr, "grad_norm": grad_norm}
    metrics["grad_norm_clipped"] = jnp.minimum(grad_norm, clip) if clip > 0 else grad_norm
    metrics["param_norm"] = dg.tree_norm(new.params)
    metrics["update_rms_lr"] = jnp.where(lr > 0, upd_rms / jnp.where(lr > 0, lr, 1.0), 0.0)
    metrics |= {"nonfinite": new.nonfinite, "finite": finite}
    if diag:
      size = sum(a.size for a in jax.tree.leaves(state_shapes(cfg.model, b, t)))
      metrics |= diag_metrics(aux, g_probe, grads, cfg.model.depth, size)
      if "blocks" in grads["params"]:  # update-to-parameter ratio per block
        blocks = lambda tree: dg.tree_layer_norms(tree["params"]["blocks"])
        metrics["update_ratio"] = blocks(updates) / blocks(state.params)
      # located from this pass's own stats: no second pass
      metrics["nonfinite_at"] = jnp.where(finite, -1, nonfinite_where(aux, g_probe[0], loss, grads))
    elif locate and cfg.train.diag_every:  # a re-run with the stats, only at a non-finite step
      where = lambda: locate_nonfinite(loss_fn, cfg, state.params, batch)
      metrics["nonfinite_at"] = jax.lax.cond(finite, lambda: jnp.full(2, -1, jnp.int32), where)
    return new, metrics

  return step


def diag_metrics(aux, sq_probe, grads, depth: int, size: int) -> dict:
  """Per-layer metrics from the model's stats and the probe gradients (all on device).

  ``sq_probe``: the gradients of ``zero_probes(squares=True)``, ``Σ (dLoss/d(state))²`` per
  state leaf (``[L, 2]`` per leaf for the layers, scalars at the collapse input); ``size``: the
  state's element count (all leaves), so ``sqrt(Σ / size)`` is the gradient RMS."""
  L2 = 2 * depth
  sq_layers, sq_out = sq_probe
  grad_rms = jnp.sqrt(sum(g.reshape(L2) for g in jax.tree.leaves(sq_layers)) / size)  # [2L]
  grad_out = jnp.sqrt(sum(jax.tree.leaves(sq_out)) / size)
  out = dg.layer_metrics(aux["stats"], grad_rms=grad_rms, grad_rms_out=grad_out)
  out["grad_rms"] = grad_rms
  for k in ("attn_logit_max", "out_logit_max", "logsumexp_mean", "logsumexp_max"):
    out[k] = aux[k]
  s = aux["stats"]
  # both over the 2L mixer layers, in the direction the signal travels (docs/interfaces.md)
  out["growth_exponent"] = dg.growth_exponent(s["rms_in"][0], s["rms_out"][-1], L2)
  out["growth_exponent_grad"] = dg.growth_exponent(grad_out, grad_rms[0], L2)
  if "blocks" in grads["params"]:
    out["layer_grad_norm"] = dg.tree_layer_norms(grads["params"]["blocks"])
  return out


def make_eval_step(model, cfg):
  def evaluate(params, batch):
    logits, _ = model.apply(params, batch["inputs"], stats=False)
    loss, _ = token_loss(logits, batch, cfg.data.target)
    out = {"eval/loss": loss}
    if "posterior" in batch:
      fm = posterior.fidelity_metrics(fit_posterior(batch, logits.shape[-1]), logits)
      for k in ("kl_bits", "entropy_gap_bits", "accuracy", "ece"):
        out[f"eval/{k}"] = fm[k]
      out["eval/kl_bits_by_pos"] = fm["kl_bits_by_position"]
      if "kl_bits_by_evidence" in fm:
        out["eval/kl_bits_by_evidence"] = fm["kl_bits_by_evidence"]
    return out

  return evaluate
