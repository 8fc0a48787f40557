"""Bayesian wind tunnels: tasks generated on the fly whose exact posterior is known.

Each sequence is a fresh problem from a PRNG key; ``batch(step, batch_size, split)`` is a pure
function of ``(seed, split, step)``. Fields, layouts, posteriors, baselines: docs/windtunnel.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mhc_jax.posterior import entropy_bits_pointwise as entropy_bits

SPLITS = {"train": 0, "validation": 1, "test": 2}

_SAMPLER_CACHE: dict = {}


@jax.jit  # one compiled program: op by op, the key was ~3 of a tiny run's 4 ms per batch
def _fold_in2(key: jax.Array, split, step) -> jax.Array:
  return jax.random.fold_in(jax.random.fold_in(key, split), step)


class WindTunnel:
  """Common `batch` machinery; subclasses define `sample(key, batch_size)` and `baselines`."""

  has_posterior = True
  vocab_size: int
  seq_len: int
  seed: int

  def _init_jit(self) -> None:
    # One compiled sampler per task configuration (the seed only enters through the key), so
    # fresh source objects with equal options (resumes, evals, tests) do not recompile.
    fields = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "seed"]
    key = (type(self), tuple(fields))
    self._sample_jit = _SAMPLER_CACHE.setdefault(key, jax.jit(self.sample, static_argnums=1))

  def key_for(self, step: int, split: str = "train") -> jax.Array:
    """The PRNG key of batch `step` of `split`: fold_in(fold_in(key(seed), split), step)."""
    if step < 0:
      raise ValueError(f"step must be >= 0, got {step}")
    if split not in SPLITS:
      raise ValueError(f"unknown split {split!r}; expected one of {sorted(SPLITS)}")
    return _fold_in2(self._seed_key, SPLITS[split], step)

  @functools.cached_property
  def _seed_key(self) -> jax.Array:
    return jax.random.key(self.seed)  # eager: any Python int seed, as jax.random.key takes it

  def batch(self, step: int, batch_size: int, split: str = "train") -> dict[str, jax.Array]:
    if batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return self._sample_jit(self.key_for(step, split), int(batch_size))


def _check_int(name: str, value: Any, lo: int, hi: int | None = None) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ValueError(f"option {name!r} must be an integer, got {value!r}")
  value = int(value)
  if value < lo or (hi is not None and value > hi):
    rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    raise ValueError(f"option {name!r} must be {rng}, got {value}")
  return value


def _check_number(name: str, value: Any, ok, what: str) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
    raise ValueError(f"option {name!r} must be {what}, got {value!r}")
  return float(value)


def _sequence(tokens, targets, mask, posterior, evidence, **extra) -> dict[str, jax.Array]:
  """One sequence's fields (docs/windtunnel.md): ``tokens [T + 1]`` gives the inputs, the entropy
  is the posterior's at the supervised positions."""
  fields = dict(inputs=tokens[:-1], targets=targets, mask=mask, posterior=posterior)
  return fields | dict(entropy=entropy_bits(posterior) * mask, evidence=evidence, **extra)


# ------------------------------------------------------------------------ Bijection elimination
def bijection_posterior(keys: jax.Array, values: jax.Array, n_symbols: int):
  """Exact posterior ``[N, V]`` over π(k_i) given pairs j < i of one sequence's keys and values
  ``[N]``, and the evidence ``[N]``: distinct values revealed before pair i."""
  V = n_symbols
  onehot = jax.nn.one_hot(values, V, dtype=jnp.float32)  # [N, V]
  revealed = (jnp.cumsum(onehot, axis=0) - onehot) > 0  # exclusive: pairs j < i
  m = jnp.sum(revealed, axis=-1)  # distinct values (= distinct keys) revealed
  seen = jnp.take_along_axis(revealed, values[:, None], axis=-1)[:, 0]
  uniform = jnp.where(revealed, 0.0, 1.0) / jnp.maximum(V - m, 1)[:, None]
  post = jnp.where(seen[:, None], onehot, uniform)
  return post.astype(jnp.float32), m.astype(jnp.int32)


@dataclasses.dataclass
class BijectionTask(WindTunnel):
  """Key -> value lookups under a fresh random permutation per sequence (options:
  docs/windtunnel.md)."""

  seq_len: int
  seed: int
  n_symbols: int = 20
  n_pairs: int | None = None
  replacement: bool = True
  supervise: str = "all"  # "query": the papers' layout, one query key from the context

  def __post_init__(self):
    self.seq_len = _check_int("seq_len", self.seq_len, 2)
    self.n_symbols = _check_int("n_symbols", self.n_symbols, 2)
    if not isinstance(self.replacement, bool):
      raise ValueError(f"option 'replacement' must be a bool, got {self.replacement!r}")
    if self.supervise not in ("all", "query"):
      raise ValueError(f"option 'supervise' must be 'all' or 'query', got {self.supervise!r}")
    max_pairs = (self.seq_len - 2 * (self.supervise == "query")) // 2
    if not self.replacement:
      max_pairs = min(max_pairs, self.n_symbols)
    self.n_pairs = _check_int(
      "n_pairs", max_pairs if self.n_pairs is None else self.n_pairs, 1, max_pairs
    )
    V = self.n_symbols
    self.bos, self.pad = 2 * V, 2 * V + 1
    self.vocab_size = 2 * V + 2
    self._init_jit()

  def sample_one(self, key: jax.Array) -> dict[str, jax.Array]:
    V, N, T = self.n_symbols, self.n_pairs, self.seq_len
    # one draw of random bits for everything (cheap to compile): the permutation and the key
    # order are argsorts of 32-bit random words, keys with replacement are words mod V
    bits = jax.random.bits(key, (2 * V + N,), jnp.uint32)
    perm = jnp.argsort(bits[:V]).astype(jnp.int32)
    if self.replacement:
      keys = (bits[2 * V :] % V).astype(jnp.int32)
    else:
      keys = jnp.argsort(bits[V : 2 * V])[:N].astype(jnp.int32)
    q_pos = 1 + 2 * jnp.arange(N)  # input positions holding the keys
    if self.supervise == "query":  # pair N + 1 repeats a context key; only it is supervised
      keys = jnp.append(keys, keys[jax.random.randint(jax.random.fold_in(key, 1), (), 0, N)])
      q_pos = q_pos[-1:] + 2
    values = perm[keys]
    post_N, evidence_N = bijection_posterior(keys, values, V)
    post_N, evidence_N = post_N[-len(q_pos) :], evidence_N[-len(q_pos) :]

    pairs = jnp.stack([keys, values + V], axis=-1).reshape(-1)  # [2N] (+ the query's pair)
    tail = jnp.full((T - len(pairs),), self.pad)
    tokens = jnp.concatenate([jnp.array([self.bos]), pairs, tail]).astype(jnp.int32)
    mask = jnp.zeros((T,), jnp.float32).at[q_pos].set(1.0)
    posterior = jnp.zeros((T, self.vocab_size), jnp.float32)
    posterior = posterior.at[q_pos, V : 2 * V].set(post_N)
    evidence = jnp.zeros((T,), jnp.int32).at[q_pos].set(evidence_N)
    return _sequence(tokens, tokens[1:], mask, posterior, evidence, permutation=perm)

  def sample(self, key: jax.Array, batch_size: int) -> dict[str, jax.Array]:
    out = jax.vmap(self.sample_one)(jax.random.split(key, batch_size))
    out.pop("permutation")
    return out

  def baselines(self, inputs) -> dict[str, np.ndarray]:
    """`uniform`: the uniform guess over the V values at every key position ([B,T,V] float64,
    zero rows elsewhere). The layout fixes the supervised positions, so `inputs` only gives
    the shape."""
    B, T = np.shape(inputs)
    V = self.n_symbols
    out = np.zeros((B, T, self.vocab_size))
    q = 2 * self.n_pairs + 1 if self.supervise == "query" else slice(1, 1 + 2 * self.n_pairs, 2)
    out[:, q, V : 2 * V] = 1.0 / V
    return {"uniform": out}


# -------------------------------------------------------------------------------- HMM filtering
def hmm_forward(log_pi0: jax.Array, log_T: jax.Array, log_E: jax.Array, obs: jax.Array):
  """Log-space forward pass over ``obs [L]`` given log_pi0 [S], log_T [S,S] (row = from), log_E
  [S,K]: ``log_predictive [L+1, K]``, row t = log p(o_{t+1} | o_1..t) (row 0: before any
  observation), and ``log_filtered [L, S]``, row t = log p(s_{t+1} | o_1..t+1)."""
  lse = jax.scipy.special.logsumexp

  def predictive(log_state):  # log p(s) -> log p(o)
    return lse(log_state[:, None] + log_E, axis=0)

  def step(log_prior_state, o):
    log_joint = log_prior_state + log_E[:, o]
    log_filt = log_joint - lse(log_joint)
    log_next = lse(log_filt[:, None] + log_T, axis=0)
    return log_next, (log_filt, predictive(log_next))

  _, (log_filtered, log_pred_rest) = jax.lax.scan(step, log_pi0, obs)
  log_pred = jnp.concatenate([predictive(log_pi0)[None], log_pred_rest], axis=0)
  return log_pred, log_filtered


def uniform_from_bits(bits: jax.Array) -> jax.Array:
  """uint32 random words -> float32 uniforms in (0, 1) (24-bit resolution, never 0 or 1)."""
  return ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / 2**24)


def dirichlet_rows(key: jax.Array, alpha: float, u: jax.Array) -> jax.Array:
  """Rows ~ Dirichlet(alpha), shape of the uniforms `u` (alpha = 1: normalised -log(u), else
  gamma draws from `key`)."""
  x = -jnp.log(u) if alpha == 1.0 else jax.random.gamma(key, alpha, u.shape)
  return x / jnp.sum(x, axis=-1, keepdims=True)


def levels_from_probs(p: jax.Array, n_levels: int) -> jax.Array:
  """Discretise probabilities to integer levels in 1..Q (Q = n_levels)."""
  return jnp.clip(jnp.round(p * n_levels), 1, n_levels).astype(jnp.int32)


def probs_from_levels(levels: jax.Array) -> jax.Array:
  """The row-stochastic matrix a header of levels stands for."""
  levels = levels.astype(jnp.float32)
  return levels / jnp.sum(levels, axis=-1, keepdims=True)


PREDICT = ("state", "observation")


@dataclasses.dataclass
class HMMTask(WindTunnel):
  """A fresh HMM per sequence, its parameters in a header; filtering (default) or prediction
  (options: docs/windtunnel.md)."""

  seq_len: int
  seed: int
  n_states: int = 5
  n_symbols: int = 5
  length: int | None = None
  alpha: float = 1.0
  n_levels: int = 10
  predict: str = "state"
  stickiness: float = 0.0

  def __post_init__(self):
    self.seq_len = _check_int("seq_len", self.seq_len, 2)
    self.n_states = _check_int("n_states", self.n_states, 1)
    self.n_symbols = _check_int("n_symbols", self.n_symbols, 2)
    self.n_levels = _check_int("n_levels", self.n_levels, 1)
    self.alpha = _check_number("alpha", self.alpha, lambda a: a > 0, "a positive number")
    if self.predict not in PREDICT:
      raise ValueError(
        f"option 'predict' must be one of {', '.join(PREDICT)}, got {self.predict!r}"
      )
    self.stickiness = _check_number(
      "stickiness", self.stickiness, lambda r: 0 <= r < 1, "a number in [0, 1)"
    )
    S, K, Q = self.n_states, self.n_symbols, self.n_levels
    self.header_len = 1 + S * S + S * K + 1  # BOS, T, E, SEP
    # filtering needs o_L among the inputs; prediction only as the last target
    max_len = self.seq_len + (0 if self.predict == "state" else 1) - self.header_len
    if max_len < 1:
      raise ValueError(
        f"seq_len={self.seq_len} too short for the HMM header ({self.header_len} tokens "
        f"for n_states={S}, n_symbols={K}) and one observation; need seq_len >= "
        f"{self.seq_len - max_len + 1}"
      )
    self.length = _check_int("length", max_len if self.length is None else self.length, 1, max_len)
    self.level_offset = K
    self.bos, self.sep, self.pad = K + Q, K + Q + 1, K + Q + 2
    by_state = self.predict == "state"  # S state-label tokens after the others
    self.state_offset = K + Q + 3 if by_state else None
    self.vocab_size = K + Q + 3 + (S if by_state else 0)
    self._init_jit()

  @property
  def answer_slice(self) -> slice:
    """The tokens the posterior lives on (state labels, or observation symbols)."""
    if self.predict == "state":
      return slice(self.state_offset, self.state_offset + self.n_states)
    return slice(0, self.n_symbols)

  def parse_header(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(T, E) float64 matrices from the header of one token sequence (numpy, for tests/probes)."""
    tokens = np.asarray(tokens)
    assert tokens[0] == self.bos and tokens[self.header_len - 1] == self.sep
    Tm, Em = self._header_matrices(tokens[None])
    return Tm[0], Em[0]

  def _header_matrices(self, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(T [B,S,S], E [B,S,K]) float64 from the headers of ``inputs [B, >= header_len]``."""
    B, S, K = len(inputs), self.n_states, self.n_symbols
    lv = inputs[:, 1 : self.header_len - 1].astype(np.float64) - self.level_offset + 1
    Tm = lv[:, : S * S].reshape(B, S, S)
    Em = lv[:, S * S :].reshape(B, S, K)
    return Tm / Tm.sum(-1, keepdims=True), Em / Em.sum(-1, keepdims=True)

  def sample_one(self, key: jax.Array) -> dict[str, jax.Array]:
    S, K, L, T, Q = self.n_states, self.n_symbols, self.length, self.seq_len, self.n_levels
    # one draw of random words for everything (cheap to compile), cut into uniforms
    k_bits, k_T, k_E = (key,) * 3 if self.alpha == 1.0 else jax.random.split(key, 3)
    sizes = [S * S, S * K, L * S, L * K]
    u = uniform_from_bits(jax.random.bits(k_bits, (sum(sizes),), jnp.uint32))
    u_T, u_E, u_s, u_o = jnp.split(u, np.cumsum(sizes)[:-1])
    p_T = dirichlet_rows(k_T, self.alpha, u_T.reshape(S, S))
    if self.stickiness > 0:
      p_T = (1.0 - self.stickiness) * p_T + self.stickiness * jnp.eye(S)
    lev_T = levels_from_probs(p_T, Q)
    lev_E = levels_from_probs(dirichlet_rows(k_E, self.alpha, u_E.reshape(S, K)), Q)
    log_T = jnp.log(probs_from_levels(lev_T))
    log_E = jnp.log(probs_from_levels(lev_E))
    log_pi0 = jnp.full((S,), -math.log(S), jnp.float32)

    # Gumbel-max sampling of the state chain, then of all emissions at once
    g_s = -jnp.log(-jnp.log(u_s.reshape(L, S)))
    g_o = -jnp.log(-jnp.log(u_o.reshape(L, K)))
    s0 = jnp.argmax(log_pi0 + g_s[0])

    def run(s, g):
      return jnp.argmax(log_T[s] + g), s

    s_last, states = jax.lax.scan(run, s0, g_s[1:])  # emits s_1..s_{L-1}, ends at s_L
    states = jnp.concatenate([states, s_last[None]])
    obs = jnp.argmax(log_E[states] + g_o, axis=-1)
    log_pred, log_filt = hmm_forward(log_pi0, log_T, log_E, obs)

    header = jnp.concatenate([lev_T.reshape(-1), lev_E.reshape(-1)]) + (self.level_offset - 1)
    tail = jnp.full((T + 1 - self.header_len - L,), self.pad)
    tokens = jnp.hstack([self.bos, header, self.sep, obs, tail]).astype(jnp.int32)
    targets = tokens[1:]

    # input positions: SEP at h-1, o_t at h-1+t (t = 1..L)
    h = self.header_len
    obs_pos = h - 1 + jnp.arange(1, L + 1)
    posterior = jnp.zeros((T, self.vocab_size), jnp.float32)
    if self.predict == "state":  # supervised: o_1..o_L, answer s_t
      q_pos = obs_pos
      posterior = posterior.at[q_pos, self.answer_slice].set(jnp.exp(log_filt))
      targets = targets.at[q_pos].set(self.state_offset + states.astype(jnp.int32))
      evidence_L = jnp.arange(1, L + 1, dtype=jnp.int32)
    else:  # supervised: SEP, o_1..o_{L-1}, answer o_{t+1}
      q_pos = h - 1 + jnp.arange(L)
      posterior = posterior.at[q_pos, :K].set(jnp.exp(log_pred[:L]))
      evidence_L = jnp.arange(L, dtype=jnp.int32)
    mask = jnp.zeros((T,), jnp.float32).at[q_pos].set(1.0)
    evidence = jnp.zeros((T,), jnp.int32).at[q_pos].set(evidence_L)
    # filtered state posterior after the observation at each input position
    state_post = jnp.zeros((T + 1, S), jnp.float32)
    state_post = state_post.at[h - 1].set(jnp.exp(log_pi0))
    state_post = state_post.at[obs_pos].set(jnp.exp(log_filt))[:T]
    return _sequence(tokens, targets, mask, posterior, evidence, state_posterior=state_post)

  def sample(self, key: jax.Array, batch_size: int) -> dict[str, jax.Array]:
    return jax.vmap(self.sample_one)(jax.random.split(key, batch_size))

  def baselines(self, inputs) -> dict[str, np.ndarray]:
    """Exact reference guesses ``{name: [B,T,V] float64}`` at the supervised positions of
    ``inputs [B,T]`` (docs/windtunnel.md, "The HMM baselines")."""
    inputs = np.asarray(inputs)
    B, T = inputs.shape
    S, K, L, h = self.n_states, self.n_symbols, self.length, self.header_len
    Tm, Em = self._header_matrices(inputs)
    n_obs = L if self.predict == "state" else L - 1  # observations among the inputs
    obs = inputs[:, h : h + n_obs].astype(np.int64)  # o_1..o_n
    # prior marginals m[t] = p(s_{t+1} | header), t = 0..L
    m = np.empty((L + 1, B, S))
    m[0] = 1.0 / S
    for t in range(L):
      m[t + 1] = np.einsum("bs,bsr->br", m[t], Tm)
    m = np.moveaxis(m, 0, 1)  # [B, L+1, S]
    e_obs = np.take_along_axis(Em, obs[:, None, :], axis=2)  # [B, S, n]: E[s, o_t]
    e_obs = np.moveaxis(e_obs, 1, 2)  # [B, n, S]
    last = m[:, :n_obs] * e_obs  # p(s_t | header, o_t), t = 1..n
    last /= last.sum(-1, keepdims=True)
    if self.predict == "state":
      ans = self.answer_slice
      pos = h - 1 + np.arange(1, L + 1)
      flat = np.full((B, L, S), 1.0 / S)  # uniform and header-blind alike
      dists = {"uniform": flat, "header_only": m[:, :L], "header_blind": flat, "last_obs": last}
    else:
      ans = slice(0, K)
      pos = h - 1 + np.arange(L)
      counts = np.zeros((B, L, K))
      onehot = np.eye(K)[obs]  # [B, L-1, K]
      counts[:, 1:] = np.cumsum(onehot, axis=1)
      nxt = np.einsum("bts,bsr->btr", last, Tm)  # p(s_{t+1} | header, o_t)
      dists = {
        "uniform": np.full((B, L, K), 1.0 / K),
        "header_only": np.einsum("bts,bsk->btk", m[:, :L], Em),
        "header_blind": (counts + 1.0) / (np.arange(L)[None, :, None] + K),
        "last_obs": np.concatenate(
          [np.einsum("bs,bsk->bk", m[:, 0], Em)[:, None], np.einsum("bts,bsk->btk", nxt, Em)],
          axis=1,
        ),
      }
    out = {name: np.zeros((B, T, self.vocab_size)) for name in dists}
    for name, d in dists.items():
      out[name][:, pos, ans] = d
    return out
