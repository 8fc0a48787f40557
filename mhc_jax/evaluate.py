"""``mhc-jax eval --run DIR [--batches N]``: posterior fidelity and geometry probes of a trained run.

Loads ``DIR/config.yaml`` and the latest orbax checkpoint in ``DIR/checkpoints`` and writes
``DIR/eval.json`` (atomically), with a short summary on stdout.

Wind tunnels (bijection, hmm), on ``N`` validation batches (batch ``i`` of the ``validation``
split, the same batches the trainer's in-loop eval starts with):

- ``metrics``: ``eval_loss`` (the training loss, in nats, against ``data.target``),
  ``kl_bits`` (KL(posterior || model) in bits per supervised position, the primary metric),
  ``entropy_gap_bits``, ``accuracy``, ``ece``, ``posterior_entropy_bits``,
  ``model_entropy_bits``, ``kl_bits_uniform`` (the KL of a uniform guess over the answer
  symbols, the reference a model must beat), and curves ``by_evidence`` / ``by_position``
  (``kl_bits``, ``entropy_gap_bits``, ``accuracy``, ``ece``, ``count``; NaN where a group has
  no position). All from :func:`mhc_jax.posterior.fidelity_metrics` over all N batches at once.
- ``probes`` (on the first ``min(N, 2)`` batches; :mod:`mhc_jax.probes`):

  - ``key_orthogonality``: attention keys grouped by hypothesis, per layer (all heads
    concatenated, globally centred). Bijection: keys at value tokens, hypothesis = the key symbol
    that value answers; also for the retrieval head alone (``retrieval_head``, with the mean
    |cos| of as many random directions in its dimension for reference). HMM: keys at
    observation tokens, grouped by the observed symbol (hidden states are relabelled in every
    sequence, so they are no hypothesis shared across sequences).
  - ``qk_alignment`` (bijection): for queries whose key was seen before, the position that holds
    the answer (the value token after the key's previous occurrence) is the target; the (layer,
    head) with the most attention on targets is the retrieval head, and the cosine between its
    query and the target's key is reported by evidence, with its slope, together with the
    attention weight on the target by evidence. HMM: null (no single target position).
  - ``pca_entropy``: PCA of the residual stream (streams summed) at supervised positions after
    each block, against the posterior entropy in bits: explained variance, Pearson correlation
    of PC1..PC3 with the entropy (sign arbitrary), per layer; the summary is the last block.
  - ``drift`` (when the run has 2+ checkpoints): attention probabilities and value vectors of
    every layer on the first validation batch at each checkpoint; relative drift between
    consecutive checkpoints and whether attention settles first (see ``probes.drift``).

Text tasks (text, tfds; no posterior): ``eval_loss`` (nats per byte) and ``bits_per_byte``.

Bad input (no such directory, no config.yaml, no checkpoint, a config that no longer validates,
``--batches < 1``) raises :class:`mhc_jax.cli.UsageError` or ``ConfigError``: one message, exit 2.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

PROBE_BATCHES = 2   # validation batches the geometry probes use
PCA_MAX_POINTS = 4096


# --------------------------------------------------------------------------------- loading


def _usage(msg: str):
  from mhc_jax.errors import UsageError
  return UsageError(msg)


def load_run(run_dir: str | os.PathLike):
  """(cfg, source, mesh, model, abstract state, Checkpoints, checkpoint steps) of a run dir."""
  from mhc_jax.train.config import ConfigError, load_config

  run = Path(run_dir)
  if not run.exists():
    raise _usage(f"--run: {run} does not exist")
  if not run.is_dir():
    raise _usage(f"--run: {run} is not a directory")
  if not (run / "config.yaml").is_file():
    raise _usage(f"--run: {run} is not a run directory (no config.yaml)")
  ck_dir = run / "checkpoints"
  if not ck_dir.is_dir() or not any(p.name.isdigit() for p in ck_dir.iterdir()):
    raise _usage(f"--run: {run} has no checkpoint in {ck_dir} (train with train.ckpt_every, "
                 f"or let the run finish: it saves one at the end)")
  try:
    cfg = load_config(run / "config.yaml")
  except ConfigError as e:
    raise ConfigError(f"{run / 'config.yaml'}: {e}") from None

  import jax.numpy as jnp

  from mhc_jax import data
  from mhc_jax.model import Transformer
  from mhc_jax.train.checkpoint import Checkpoints
  from mhc_jax.train.config import with_data_vocab
  from mhc_jax.train.optim import make_optimizer
  from mhc_jax.train.state import abstract_state, state_shardings

  try:
    source = data.make_source(cfg.data.task, seq_len=cfg.data.seq_len, seed=cfg.train.seed,
                              **cfg.data.options)
  except (ValueError, FileNotFoundError) as e:
    raise ConfigError(f"data.options: {e}") from None
  cfg = with_data_vocab(cfg, source.vocab_size)
  mesh = _eval_mesh(cfg)
  model = Transformer(cfg.model)
  tx, _ = make_optimizer(cfg.optim, cfg.train.steps)
  example = jnp.zeros((1, cfg.data.seq_len), jnp.int32)
  shard = state_shardings(model, example, tx, mesh)
  abstract = abstract_state(shard, model, example, tx)
  ckpt = Checkpoints(ck_dir, keep=None, async_save=False)
  steps = sorted(int(s) for s in ckpt.mngr.all_steps())
  if not steps:
    ckpt.close()
    raise _usage(f"--run: {run} has no complete checkpoint in {ck_dir}")
  return cfg, source, mesh, model, abstract, ckpt, steps


def _eval_mesh(cfg):
  """The run's mesh when it fits this machine's devices, else a single-device one."""
  import jax

  from mhc_jax.train import sharding as sh
  from mhc_jax.train.config import ConfigError, MeshConfig
  try:
    return sh.make_mesh(cfg.mesh, cfg.data.batch_size)
  except ConfigError:
    return sh.make_mesh(MeshConfig(data=1), None, devices=jax.devices()[:1])


def restore_params(ckpt, abstract, step: int, run: Path):
  try:
    state, _ = ckpt.restore(abstract, step)
  except Exception as e:  # orbax raises many kinds; the first line says what went wrong
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    raise _usage(f"--run: cannot restore checkpoint {step} of {run} "
                 f"({type(e).__name__}: {first})") from None
  return state.params


# --------------------------------------------------------------------------------- metrics


def _forward_fns(model, cfg):
  import jax
  import jax.numpy as jnp

  from mhc_jax.train.step import token_loss

  def fwd(params, batch):
    logits, _ = model.apply(params, batch["inputs"])
    loss, _ = token_loss(logits, batch, cfg.data.target)
    return logits, loss, jnp.sum(batch["mask"])

  def inter(params, tokens):
    (logits, _), st = model.apply(
        params, tokens, mutable=["intermediates"],
        capture_intermediates=lambda mdl, name: mdl.name == "value" and name == "__call__")
    return st["intermediates"]

  return jax.jit(fwd), jax.jit(inter)


def _batches(source, cfg, n: int, mesh) -> list[dict]:
  from mhc_jax.train import sharding as sh
  from mhc_jax.train.loop import host_batch
  out = []
  for i in range(n):
    b = host_batch(source, cfg, i, split="validation")
    b.pop("plant", None)
    out.append((b, sh.put_batch(b, mesh)))
  return out


def pad_vocab(dist: np.ndarray, vocab: int) -> np.ndarray:
  """Zero-pad distributions over the data's vocabulary to the model's (model.vocab may exceed
  the data's: the extra tokens get no posterior mass)."""
  extra = vocab - dist.shape[-1]
  if extra < 0:
    raise ValueError(f"model vocabulary {vocab} is smaller than the data's {dist.shape[-1]}")
  return dist if extra == 0 else np.pad(dist, [(0, 0)] * (dist.ndim - 1) + [(0, extra)])


def fidelity(host_batches: list[dict], logits: list[np.ndarray]) -> dict:
  """posterior.fidelity_metrics over all batches at once, plus the uniform-guess KL."""
  import jax

  from mhc_jax import posterior as P
  cat = {k: np.concatenate([b[k] for b in host_batches]) for k in ("posterior", "mask", "evidence")}
  lg = np.concatenate(logits)
  cat["posterior"] = pad_vocab(cat["posterior"], lg.shape[-1])
  G = int(cat["evidence"].max()) + 1
  fm = jax.device_get(P.fidelity_metrics(cat, lg, num_groups=G))
  # uniform guess over the answer symbols (every token the posterior ever gives mass to)
  support = (cat["posterior"] * cat["mask"][..., None]).reshape(-1, lg.shape[-1]).max(0) > 0
  uni = np.where(support, 0.0, -1e9).astype(np.float32)
  kl_uni = float(P.kl_bits(cat["posterior"], np.broadcast_to(uni, lg.shape), cat["mask"]))
  out = {k: float(fm[k]) for k in ("kl_bits", "entropy_gap_bits", "accuracy", "ece",
                                   "posterior_entropy_bits", "model_entropy_bits")}
  out["kl_bits_uniform"] = kl_uni
  for g in ("evidence", "position"):
    out[f"by_{g}"] = {k: np.asarray(fm[f"{k}_by_{g}"], np.float64)
                      for k in ("kl_bits", "entropy_gap_bits", "accuracy", "ece")}
    out[f"by_{g}"]["count"] = np.asarray(fm[f"count_by_{g}"], np.float64)
  out["positions"] = int(cat["mask"].sum())
  return out


# --------------------------------------------------------------------------------- probes


def stacked_intermediates(inter: dict, depth: int) -> dict[str, np.ndarray]:
  """Model intermediates as numpy arrays with a leading layer axis, scanned or not.

  Returns ``stream [L,B,T,n,C]``, ``q``/``k``/``value [L,B,T,H,D]``, ``attn [L,B,H,T,S]``.
  """
  import jax

  def unpack(tree):
    a = tree["attn"]
    return {"stream": tree["stream"][0], "q": a["q"][0], "k": a["k"][0], "attn": a["attn"][0],
            "value": a["value"]["__call__"][0]}

  inter = jax.device_get(inter)
  if "blocks" in inter:
    return {k: np.asarray(v) for k, v in unpack(inter["blocks"]).items()}
  per = [unpack(inter[f"block_{l}"]) for l in range(depth)]
  return {k: np.stack([np.asarray(p[k]) for p in per]) for k in per[0]}


def _cat_inter(parts: list[dict]) -> dict:
  """Concatenate per-batch intermediates along the batch axis (axis 1)."""
  return {k: np.concatenate([p[k] for p in parts], axis=1) for k in parts[0]}


def bijection_targets(inputs: np.ndarray, mask: np.ndarray, n_symbols: int) -> np.ndarray:
  """For each supervised key position, the input position of the value that answers it when the
  key occurred before (the value token after its latest earlier occurrence), else -1. [B,T]."""
  B, T = inputs.shape
  tgt = np.full((B, T), -1, np.int64)
  for b in range(B):
    last: dict[int, int] = {}
    for t in range(T):
      if mask[b, t] <= 0:
        continue
      k = int(inputs[b, t])
      if k in last and last[k] + 1 < T:
        tgt[b, t] = last[k] + 1
      last[k] = t
  return tgt


def _finite(x) -> float | None:
  x = float(x)
  return x if math.isfinite(x) else None


def key_orthogonality_probe(k: np.ndarray, positions, hyp: np.ndarray, grouping: str,
                            head: tuple[int, int] | None = None) -> dict:
  """Keys [L,B,T,H,D] at `positions` grouped by `hyp`: per layer with all heads concatenated,
  the last layer as the summary, and (when given) the single (layer, head) `head`."""
  from mhc_jax import probes
  L = k.shape[0]
  bi, ti = positions
  if len(np.unique(hyp)) < 2:
    return {"grouping": grouping, "skipped": "fewer than two hypotheses in the probe batches"}
  per_layer = [probes.key_orthogonality(k[l][bi, ti].reshape(len(bi), -1), hyp, center=True)
               for l in range(L)]
  last = per_layer[-1]
  out = {
      "grouping": grouping,
      "layer": L - 1,
      "hypotheses": int(len(last["hypotheses"])),
      "points": int(len(bi)),
      "mean_abs_cos": last["mean_abs_cos"],
      "max_abs_cos": last["max_abs_cos"],
      "within_cos": last["within_cos"],
      "mean_abs_cos_by_layer": [r["mean_abs_cos"] for r in per_layer],
      "within_cos_by_layer": [r["within_cos"] for r in per_layer],
  }
  if head is not None:
    l, h = head
    r = probes.key_orthogonality(k[l][bi, ti, h], hyp, center=True)
    # reference: mean |cos| of as many random directions in the head's dimension
    rng = np.random.default_rng(0)
    rand = rng.standard_normal((len(r["hypotheses"]), k.shape[-1]))
    rand /= np.linalg.norm(rand, axis=-1, keepdims=True)
    rc = rand @ rand.T
    off = ~np.eye(len(rc), dtype=bool)
    out["retrieval_head"] = {"layer": int(l), "head": int(h), "mean_abs_cos": r["mean_abs_cos"],
                             "max_abs_cos": r["max_abs_cos"], "within_cos": r["within_cos"],
                             "random_mean_abs_cos": float(np.abs(rc[off]).mean())}
  return out


def qk_alignment_probe(it: dict, tgt: np.ndarray, evidence: np.ndarray, G: int) -> dict:
  from mhc_jax import probes
  bi, ti = np.nonzero(tgt >= 0)
  if len(bi) < 2:
    return {"skipped": "no query whose key was seen before (bijection with replacement=false?)"}
  si = tgt[bi, ti]
  attn = it["attn"]  # [L,B,H,T,S]
  on_target = attn[:, bi, :, ti, si]  # [N, L, H] (advanced indices first)
  on_target = np.moveaxis(on_target, 0, -1)  # [L, H, N]
  mean_on = on_target.mean(-1)
  layer, head = np.unravel_index(int(np.argmax(mean_on)), mean_on.shape)
  q = it["q"][layer][bi, ti, head]
  k = it["k"][layer][bi, si, head]
  ev = evidence[bi, ti]
  r = probes.qk_alignment_by_evidence(q, k, ev, num_groups=G)
  a = on_target[layer, head]
  cnt = np.bincount(ev, minlength=G).astype(np.float64)
  with np.errstate(invalid="ignore", divide="ignore"):
    attn_by_ev = np.where(cnt > 0, np.bincount(ev, weights=a, minlength=G) / cnt, np.nan)
  return {
      "layer": int(layer), "head": int(head), "points": int(len(bi)),
      "attn_on_target": float(a.mean()),
      "attn_on_target_by_layer_head": mean_on,
      "cos_mean": float(r["cos"].mean()),
      "alignment_by_evidence": r["alignment"],
      "attn_on_target_by_evidence": attn_by_ev,
      "count_by_evidence": r["count"],
      "slope": r["slope"],
  }


def pca_probe(stream: np.ndarray, positions, entropy: np.ndarray, seed: int = 0) -> dict:
  from mhc_jax import probes
  bi, ti = positions
  n = len(bi)
  if n > PCA_MAX_POINTS:
    sel = np.sort(np.random.default_rng(seed).choice(n, PCA_MAX_POINTS, replace=False))
    bi, ti = bi[sel], ti[sel]
  h = entropy[bi, ti]
  if np.std(h) == 0:
    return {"skipped": "the posterior entropy is constant on the probe positions"}
  per_layer = []
  for l in range(stream.shape[0]):
    X = stream[l][bi, ti].sum(axis=-2)  # streams summed: [N, C]
    per_layer.append(probes.pca_vs_entropy(X, h, k=3))
  last = per_layer[-1]
  return {
      "layer": stream.shape[0] - 1,
      "points": int(len(bi)),
      "explained_variance_ratio": last["explained_variance_ratio"],
      "corr_entropy": last["corr_entropy"],
      "corr_pc1_entropy": last["corr_pc1_entropy"],
      "abs_corr_pc1_entropy": last["abs_corr_pc1_entropy"],
      "abs_corr_pc1_entropy_by_layer": [r["abs_corr_pc1_entropy"] for r in per_layer],
      "pc1_variance_by_layer": [float(r["explained_variance_ratio"][0]) for r in per_layer],
  }


def drift_probe(series_attn: list[np.ndarray], series_value: list[np.ndarray], steps) -> dict:
  from mhc_jax import probes
  r = probes.drift(np.stack(series_attn), np.stack(series_value))
  by_layer = [probes.drift(np.stack([a[l] for a in series_attn]),
                           np.stack([v[l] for v in series_value]))
              for l in range(series_attn[0].shape[0])]
  return {
      "steps": list(steps),
      "attn_drift": r["attn_drift"], "value_drift": r["value_drift"],
      "attn_fall": r["attn_fall"], "value_fall": r["value_fall"],
      "attention_settles_first": r["attention_settles_first"],
      "attn_drift_by_layer": [d["attn_drift"] for d in by_layer],
      "value_drift_by_layer": [d["value_drift"] for d in by_layer],
  }


def geometry(cfg, source, params, inter_fn, host_batches, dev_batches) -> dict:
  from mhc_jax.posterior import entropy_bits_pointwise
  it = _cat_inter([stacked_intermediates(inter_fn(params, d["inputs"]), cfg.model.depth)
                   for d in dev_batches])
  hb = {k: np.concatenate([b[k] for b in host_batches]) for k in host_batches[0]}
  mask, inputs, evidence = hb["mask"], hb["inputs"], hb["evidence"].astype(np.int64)
  entropy = np.asarray(entropy_bits_pointwise(hb["posterior"])) * mask
  sup = np.nonzero(mask > 0)
  G = int(evidence.max()) + 1
  out: dict[str, Any] = {"batches": len(host_batches)}
  if cfg.data.task == "bijection":
    V = source.n_symbols
    vpos = np.nonzero((inputs >= V) & (inputs < 2 * V))
    vpos = (vpos[0][vpos[1] > 0], vpos[1][vpos[1] > 0])
    hyp = inputs[vpos[0], vpos[1] - 1]
    qk = qk_alignment_probe(it, bijection_targets(inputs, mask, V), evidence, G)
    head = (qk["layer"], qk["head"]) if "layer" in qk else None
    out["key_orthogonality"] = key_orthogonality_probe(
        it["k"], vpos, hyp, "key symbol answered by the value token", head)
    out["qk_alignment"] = qk
  else:  # hmm
    K = source.n_symbols
    h = source.header_len
    opos = np.nonzero((inputs < K) & (np.arange(inputs.shape[1])[None, :] >= h))
    out["key_orthogonality"] = key_orthogonality_probe(
        it["k"], opos, inputs[opos], "observed symbol")
    out["qk_alignment"] = {"skipped": "HMM filtering has no single target position to retrieve"}
  out["pca_entropy"] = pca_probe(it["stream"], sup, entropy)
  return out


# --------------------------------------------------------------------------------- driver


def evaluate_run(run_dir: str | os.PathLike, batches: int = 8) -> dict:
  """Evaluate a run directory's latest checkpoint; returns what eval.json holds."""
  import jax

  if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
    raise _usage(f"--batches must be a positive integer, got {batches!r}")
  t0 = time.perf_counter()
  run = Path(run_dir)
  cfg, source, mesh, model, abstract, ckpt, steps = load_run(run)
  try:
    params = restore_params(ckpt, abstract, steps[-1], run)
    fwd, inter = _forward_fns(model, cfg)
    pairs = _batches(source, cfg, batches, mesh)
    host_b, dev_b = [p[0] for p in pairs], [p[1] for p in pairs]
    logits, loss_sum, count = [], 0.0, 0.0
    for d in dev_b:
      lg, loss, n = fwd(params, d)
      loss, n = jax.device_get((loss, n))
      if source.has_posterior:
        logits.append(np.asarray(jax.device_get(lg)))
      loss_sum += float(loss) * float(n)
      count += float(n)
    eval_loss = loss_sum / max(count, 1.0)
    result: dict[str, Any] = {
        "run": str(run), "task": cfg.data.task, "step": steps[-1], "checkpoint_steps": steps,
        "batches": batches, "batch_size": cfg.data.batch_size, "seq_len": cfg.data.seq_len,
        "mixer": cfg.model.mixer, "target": cfg.data.target,
    }
    if not source.has_posterior:
      result["metrics"] = {"eval_loss": eval_loss, "bits_per_byte": eval_loss / math.log(2),
                           "positions": int(count)}
    else:
      result["metrics"] = {"eval_loss": eval_loss, **fidelity(host_b, logits)}
      np_ = min(batches, PROBE_BATCHES)
      probes_out = geometry(cfg, source, params, inter, host_b[:np_], dev_b[:np_])
      if len(steps) >= 2:
        attn_s, val_s = [], []
        for s in steps:
          p = params if s == steps[-1] else restore_params(ckpt, abstract, s, run)
          it = stacked_intermediates(inter(p, dev_b[0]["inputs"]), cfg.model.depth)
          attn_s.append(it["attn"])
          val_s.append(it["value"])
        probes_out["drift"] = drift_probe(attn_s, val_s, steps)
      else:
        probes_out["drift"] = {"skipped": f"needs 2+ checkpoints, the run has {len(steps)}"}
      result["probes"] = probes_out
  finally:
    ckpt.close()
  result["wall_s"] = time.perf_counter() - t0
  return result


def _plain(o: Any) -> Any:
  if isinstance(o, dict):
    return {str(k): _plain(v) for k, v in o.items()}
  if isinstance(o, (list, tuple)):
    return [_plain(v) for v in o]
  if isinstance(o, (np.ndarray, np.generic)) or hasattr(o, "__array__"):
    a = np.asarray(o)
    return a.item() if a.ndim == 0 else a.tolist()
  return o


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
  """Write JSON to ``path`` via a temporary file and rename (readers never see half a file).
  Non-finite floats (empty groups of a curve) are written as NaN, as in metrics.jsonl."""
  path = Path(path)
  tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(_plain(obj), f, indent=1)
    f.write("\n")
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def summary_lines(r: dict) -> list[str]:
  m = r["metrics"]
  lines = [f"eval of {r['run']} at step {r['step']} ({r['task']}, {r['batches']} validation "
           f"batches of {r['batch_size']})"]
  if "kl_bits" not in m:
    lines.append(f"  eval loss {m['eval_loss']:.4f} nats/byte = {m['bits_per_byte']:.4f} "
                 "bits/byte")
    return lines
  lines.append(f"  KL {m['kl_bits']:.4f} bits/position (uniform guess {m['kl_bits_uniform']:.3f})"
               f"  entropy gap {m['entropy_gap_bits']:.4f}  accuracy {m['accuracy']:.3f}"
               f"  ECE {m['ece']:.3f}  eval loss {m['eval_loss']:.4f}")
  p = r.get("probes", {})
  bits = []
  ko = p.get("key_orthogonality", {})
  if "mean_abs_cos" in ko:
    rh = ko.get("retrieval_head")
    bits.append(f"keys mean |cos| {ko['mean_abs_cos']:.3f}" + (
        f" (retrieval head {rh['mean_abs_cos']:.3f}, random {rh['random_mean_abs_cos']:.3f})"
        if rh else ""))
  qk = p.get("qk_alignment", {})
  if "slope" in qk:
    bits.append(f"retrieval head L{qk['layer']}H{qk['head']} attn on target "
                f"{qk['attn_on_target']:.2f}, q-k cos slope {qk['slope']:+.4f}/evidence")
  pc = p.get("pca_entropy", {})
  if "corr_pc1_entropy" in pc:
    bits.append(f"PC1 vs entropy r = {pc['corr_pc1_entropy']:+.3f}")
  dr = p.get("drift", {})
  if "attention_settles_first" in dr:
    bits.append(f"attention settles first: {'yes' if dr['attention_settles_first'] else 'no'}")
  if bits:
    lines.append("  " + "; ".join(bits))
  return lines


def main(args) -> int:
  run = Path(args.run)
  result = evaluate_run(run, getattr(args, "batches", 8))
  write_json_atomic(run / "eval.json", result)
  for line in summary_lines(result):
    print(line)
  print(f"wrote {run / 'eval.json'} ({result['wall_s']:.1f}s)")
  return 0
