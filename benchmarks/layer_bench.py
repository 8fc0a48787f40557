"""The formulations behind the step's CPU speed-ups (docs/performance.md), side by side in
one process: forward + backward median time of

- a GELU MLP (C -> 4C -> C) applied over ``[B, T, C]`` against the same over ``[B*T, C]``;
- causal attention scores and values (softmax between) with heads after time ``[B, T, H, D]``
  against heads before time ``[B, H, T, D]`` (batch axes lead), and the model's
  ``causal_attention`` (``model.attention: materialized``);
- the stream mix ``x' = H_res x + H_postᵀ F`` with per-token coefficients: autodiff of the
  einsum form, autodiff of the written-out sum, and ``mixers.cpu_mix.mix`` (hand-written VJP, the CPU kernel);
  and its forward reading its inputs out of ``[L, ...]`` stacks at a traced layer index (as
  ``nn.scan``'s backward reads the saved values of each layer) against plain arrays.

    python benchmarks/layer_bench.py                 # B=8, T=256, C=256, n=4 (step_bench's shape)
    python benchmarks/layer_bench.py --tokens 4096 --width 512

Each takes the sum of squares of its output as the loss, gradients with respect to every input.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from timing import median_time

from mhc_jax.mixers.cpu_mix import mix, stream_sum
from mhc_jax.model.layers import causal_attention


def mlp(x, w1, w2):
  return jax.nn.gelu(x @ w1) @ w2


def mix_einsum(x, f, h, p):
  return jnp.einsum("...ij,...jc->...ic", h, x) + p[..., :, None] * f[..., None, :]


def mix_written_out(x, f, h, p):
  return stream_sum(h, x[..., None, :, :]) + p[..., :, None] * f[..., None, :]


def attn_bthd(q, k, v):
  s = jnp.einsum("bthd,bshd->bhts", q, k) / q.shape[-1] ** 0.5
  s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -1e30)
  return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v)


def attn_bhtd(q, k, v):
  q, k, v = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))
  s = jnp.einsum("bhtd,bhsd->bhts", q, k) / q.shape[-1] ** 0.5
  s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -1e30)
  return jnp.swapaxes(jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, -1), v), 1, 2)


def grad_time(fn, args, steps: int) -> float:
  g = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=tuple(range(len(args)))))
  return median_time(lambda: g(*args), steps, 3)[1]


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--tokens", type=int, default=256, help="sequence length T")
  ap.add_argument("--width", type=int, default=256)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--n", type=int, default=4, help="streams")
  ap.add_argument("--steps", type=int, default=9)
  a = ap.parse_args()
  b, t, c, n = a.batch, a.tokens, a.width, a.n
  k = jax.random.split(jax.random.PRNGKey(0), 7)
  x = jax.random.normal(k[0], (b, t, c))
  w1 = jax.random.normal(k[1], (c, 4 * c)) / c**0.5
  w2 = jax.random.normal(k[2], (4 * c, c)) / (4 * c) ** 0.5
  flat = lambda x, w1, w2: mlp(x.reshape(-1, c), w1, w2).reshape(x.shape)
  t3, t2 = grad_time(mlp, (x, w1, w2), a.steps), grad_time(flat, (x, w1, w2), a.steps)
  print(f"MLP fwd+bwd over [B, T, C]: {t3 * 1e3:.1f} ms, over [B*T, C]: {t2 * 1e3:.1f} ms")
  print(f"  ratio {t3 / t2:.2f}")
  qkv = tuple(jax.random.normal(k[i], (b, t, a.heads, c // a.heads)) for i in (1, 2, 3))
  ta, tb = grad_time(attn_bthd, qkv, a.steps), grad_time(attn_bhtd, qkv, a.steps)
  print(f"attention fwd+bwd, [B, T, H, D]: {ta * 1e3:.1f} ms, [B, H, T, D]: {tb * 1e3:.1f} ms")
  print(f"  ratio {ta / tb:.2f}")

  def materialized(q, k, v):
    q, k, v = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))
    return jnp.swapaxes(causal_attention(q, k, v)[0], 1, 2)

  tc = grad_time(materialized, qkv, a.steps)
  print(f"  the model's materialized form: {tc * 1e3:.1f} ms, {tb / tc:.2f}x faster")
  xs = jax.random.normal(k[3], (b, t, n, c))
  args = (xs, jax.random.normal(k[4], (b, t, c)))
  args += (jax.random.normal(k[5], (b, t, n, n)), jax.random.normal(k[6], (b, t, n)))
  for name, fn in [("einsum", mix_einsum), ("written out", mix_written_out), ("mix (VJP)", mix)]:
    print(f"stream mix fwd+bwd, {name:>11}: {grad_time(fn, args, a.steps) * 1e3:.1f} ms")
  # the backward of nn.scan reads each layer's saved values out of [L, ...] stacks: XLA fuses
  # that dynamic slice into the element-wise op that consumes it
  layers = 8
  stacks = [jnp.broadcast_to(v, (layers,) + v.shape) + 0.0 for v in args]
  at = jax.jit(lambda stacks, i: mix_written_out(*(v[i] for v in stacks)))
  plain = jax.jit(mix_written_out)
  i = jnp.int32(layers // 2)
  t_at = median_time(lambda: at(stacks, i), a.steps, 3)[1]
  t_plain = median_time(lambda: plain(*args), a.steps, 3)[1]
  print(
    f"stream mix forward from [L, ...] stacks at a traced layer: {t_at * 1e3:.2f} ms, "
    f"from plain arrays: {t_plain * 1e3:.2f} ms ({t_at / t_plain:.1f}x)"
  )


if __name__ == "__main__":
  main()
