"""Bayesian wind tunnel: a residual Transformer against a parameter-matched MLP and exact baselines.

The Transformer is trained by the project's trainer (`mhc_jax.train.loop`) from a config
(default configs/bijection.yaml) into OUT/transformer and evaluated by `mhc_jax.evaluate`
(posterior.fidelity_metrics on fresh validation batches, plus the geometry probes). The baseline
is a `WindowMLP` whose window covers the whole sequence, its width chosen by `match_width` so that
its parameter count matches the Transformer's; it is trained on the same train batches with the
same loss (data.target), optimiser and number of steps by a small jitted optax loop, and
evaluated with posterior.fidelity_metrics on the same validation batches.

Prints the mean KL(posterior || model) in bits per position for both, beside the task's exact
baselines on the same positions (bijection: uniform; HMM filtering: uniform, header-only,
header-blind, last-observation, and whether KL <= header-only / 10 was reached), parameter counts
and wall times, and writes OUT/windtunnel_kl.json. Usage:

  python benchmarks/windtunnel_kl.py                      # configs/bijection.yaml
  python benchmarks/windtunnel_kl.py --set train.steps=2000 --mlp-embed 16
  python benchmarks/windtunnel_kl.py --skip-mlp --out runs/wt   # the Transformer only
  python benchmarks/windtunnel_kl.py --skip-mlp --set data.target=sample train.steps=15000
                                    # trained on sampled targets instead of the exact posterior
  python benchmarks/windtunnel_kl.py --config configs/hmm.yaml  # HMM filtering

Results and timings on a 2-core CPU: docs/windtunnel_results.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mhc_jax import evaluate, storage
from mhc_jax.baselines import WindowMLP, match_width, param_count, window_mlp_param_count
from mhc_jax.train import config as C
from mhc_jax.train.loop import host_batch, prepare, train
from mhc_jax.train.optim import make_optimizer
from mhc_jax.train.step import token_loss

KEYS = ("inputs", "targets", "mask", "posterior", "evidence")


def machine() -> dict:
  try:
    cores = len(os.sched_getaffinity(0))
  except AttributeError:  # pragma: no cover - not Linux
    cores = os.cpu_count()
  load = os.getloadavg() if hasattr(os, "getloadavg") else None
  return {
    "platform": platform.platform(),
    "processor": platform.processor() or platform.machine(),
    "cores": cores,
    "jax_backend": jax.default_backend(),
    "devices": [str(d) for d in jax.devices()],
    "loadavg_at_start": load,
  }


def train_mlp(cfg, source, target_params: int, args) -> dict:
  """Train the parameter-matched WindowMLP; returns its params, counts and wall time."""
  V, T = source.vocab_size, cfg.data.seq_len
  window = args.mlp_window or T
  width = match_width(target_params, V, window, args.mlp_depth, args.mlp_embed)
  mlp = WindowMLP(
    vocab=V, width=width, window=window, depth=args.mlp_depth, embed_dim=args.mlp_embed
  )
  steps = args.mlp_steps or cfg.train.steps
  tx, _ = make_optimizer(cfg.optim, steps)
  params = mlp.init(jax.random.PRNGKey(cfg.train.seed), jnp.zeros((1, T), jnp.int32))
  n = param_count(params)
  assert n == window_mlp_param_count(V, width, window, args.mlp_depth, args.mlp_embed)
  opt = tx.init(params)

  @jax.jit
  def step(params, opt, batch):
    def loss_fn(p):
      return token_loss(mlp.apply(p, batch["inputs"]), batch, cfg.data.target)[0]

    loss, g = jax.value_and_grad(loss_fn)(params)
    upd, opt = tx.update(g, opt, params)
    return jax.tree.map(jnp.add, params, upd), opt, loss

  t0 = time.perf_counter()
  loss = float("nan")
  every = max(1, steps // 10)
  for i in range(steps):
    b = {k: v for k, v in source.batch(i, cfg.data.batch_size).items() if k in KEYS}
    params, opt, loss = step(params, opt, b)
    if (i + 1) % every == 0 or i + 1 == steps:
      print(
        f"  mlp step {i + 1}/{steps} loss {float(loss):.4f} "
        f"elapsed {time.perf_counter() - t0:.0f}s",
        flush=True,
      )
  jax.block_until_ready(params)
  return {
    "model": mlp,
    "params": params,
    "param_count": n,
    "width": width,
    "window": window,
    "depth": args.mlp_depth,
    "embed_dim": args.mlp_embed,
    "steps": steps,
    "final_loss": float(loss),
    "wall_s": time.perf_counter() - t0,
  }


def mlp_fidelity(mlp, params, cfg, source, n_batches: int) -> dict:
  fwd = jax.jit(mlp.apply)
  hb = [host_batch(source, cfg, i, split="validation") for i in range(n_batches)]
  logits = [np.asarray(fwd(params, b["inputs"])) for b in hb]
  return evaluate.fidelity(hb, logits, source)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", default="configs/bijection.yaml")
  ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="config overrides")
  ap.add_argument("--out", help="output directory (default runs/windtunnel_kl/<time>)")
  ap.add_argument("--eval-batches", type=int, default=16, help="validation batches to average")
  ap.add_argument("--mlp-depth", type=int, default=2, help="hidden layers of the MLP")
  ap.add_argument("--mlp-embed", type=int, default=16, help="token embedding size of the MLP")
  ap.add_argument("--mlp-window", type=int, default=0, help="MLP window (default seq_len)")
  ap.add_argument("--mlp-steps", type=int, default=0, help="MLP steps (default train.steps)")
  ap.add_argument("--skip-mlp", action="store_true")
  args = ap.parse_args(argv)

  try:
    cfg = C.load_config(args.config, args.set)
    setup = prepare(cfg)
  except C.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  cfg, source = setup.cfg, setup.source
  if not source.has_posterior:
    print(f"error: data.task={cfg.data.task!r} has no exact posterior", file=sys.stderr)
    return 2
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  out = Path(args.out or Path("runs") / "windtunnel_kl" / stamp)
  run_dir = out / "transformer"
  if run_dir.exists() and any(run_dir.iterdir()):
    print(f"error: --out: {run_dir} already holds a run", file=sys.stderr)
    return 2
  info = machine()
  opts = cfg.data.options
  print(
    f"machine: {info['cores']} cores, {info['jax_backend']}, load average at start "
    f"{info['loadavg_at_start']}"
  )
  if cfg.data.task == "bijection":
    print(
      f"task: bijection V={opts.get('n_symbols', 20)}, seq_len {cfg.data.seq_len}, "
      f"{source.n_pairs} pairs, replacement={source.replacement}, target={cfg.data.target}"
    )
  else:
    print(f"task: {cfg.data.task} {opts}, seq_len {cfg.data.seq_len}, target={cfg.data.target}")

  t0 = time.perf_counter()
  summary = train(setup, run_dir, progress=True)
  t_train = time.perf_counter() - t0
  t1 = time.perf_counter()
  ev = evaluate.evaluate_run(run_dir, args.eval_batches)
  storage.write_json_atomic(run_dir / "eval.json", ev)
  t_eval = time.perf_counter() - t1
  tm = ev["metrics"]
  n_tr = int(summary["params"]["total"])
  rows = [
    {
      "model": f"Transformer (residual, L={cfg.model.depth}, d={cfg.model.width}, "
      f"H={cfg.model.heads})",
      "params": n_tr,
      "steps": summary["steps"],
      "train_wall_s": t_train,
      "kl_bits": tm["kl_bits"],
      "accuracy": tm["accuracy"],
      "entropy_gap_bits": tm["entropy_gap_bits"],
      "ece": tm["ece"],
    }
  ]
  result = {
    "config": C.to_dict(cfg),
    "machine": info,
    "command": " ".join(sys.argv),
    "transformer": {"summary": summary, "eval": ev, "train_wall_s": t_train, "eval_wall_s": t_eval},
  }
  if not args.skip_mlp:
    print(f"training the parameter-matched WindowMLP ({n_tr} parameters to match)")
    m = train_mlp(cfg, source, n_tr, args)
    mm = mlp_fidelity(m["model"], m["params"], cfg, source, args.eval_batches)
    rows.append(
      {
        "model": f"WindowMLP (depth {m['depth']}, width {m['width']}, window "
        f"{m['window']}, embed {m['embed_dim']})",
        "params": m["param_count"],
        "steps": m["steps"],
        "train_wall_s": m["wall_s"],
        "kl_bits": mm["kl_bits"],
        "accuracy": mm["accuracy"],
        "entropy_gap_bits": mm["entropy_gap_bits"],
        "ece": mm["ece"],
      }
    )
    result["mlp"] = {k: v for k, v in m.items() if k not in ("model", "params")}
    result["mlp"]["metrics"] = mm
  result["rows"] = rows
  result["uniform_guess_kl_bits"] = tm["kl_bits_uniform"]
  result["baselines_kl_bits"] = {k: v["kl_bits"] for k, v in tm.get("baselines", {}).items()}
  if "filtering" in tm:
    result["filtering"] = tm["filtering"]
  result["total_wall_s"] = time.perf_counter() - t0

  print(
    f"\nmean KL(posterior || model), bits per position, over {args.eval_batches} fresh "
    f"validation batches ({tm['positions']} positions); uniform guess "
    f"{tm['kl_bits_uniform']:.3f}"
  )
  print(
    f"{'model':<58} {'params':>8} {'steps':>6} {'train s':>8} {'KL bits':>8} {'acc':>6}"
    f" {'H gap':>7}"
  )
  for r in rows:
    print(
      f"{r['model']:<58} {r['params']:>8,} {r['steps']:>6} {r['train_wall_s']:>8.0f} "
      f"{r['kl_bits']:>8.4f} {r['accuracy']:>6.3f} {r['entropy_gap_bits']:>7.4f}"
    )
  for name, kl in result["baselines_kl_bits"].items():
    print(f"{'baseline: ' + name.replace('_', '-'):<58} {'':>8} {'':>6} {'':>8} {kl:>8.4f}")
  if "filtering" in tm:
    f = tm["filtering"]
    print(
      f"filtering (Transformer KL <= header-only / 10 = {f['threshold_bits']:.4f}): "
      f"{'reached' if f['reached'] else 'NOT reached'} (KL = {f['kl_over_header_only']:.3f} x "
      f"header-only; {'beats' if f['beats_last_obs'] else 'does not beat'} last-obs)"
    )
  print(
    "KL by evidence (Transformer): "
    + " ".join(f"{x:.3f}" for x in np.asarray(tm["by_evidence"]["kl_bits"])[:21])
  )
  out.mkdir(parents=True, exist_ok=True)
  storage.write_json_atomic(out / "windtunnel_kl.json", result)
  print(f"total wall time {result['total_wall_s']:.0f}s; results: {out / 'windtunnel_kl.json'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
