"""The train step against the machine, in one of four modes (one step, one set of shape options:
benchmarks/train_step.py builds the project's own jitted train step for every mode).

    python benchmarks/step_bench.py                       # --mode time at the issue-14 shape
    python benchmarks/step_bench.py --mixers residual,mhc --variants scan,loop,diag
    python benchmarks/step_bench.py --width 2048 --depth 8 --batch 8 --seq-len 1024 # GPU size
    python benchmarks/step_bench.py --mode dots --mixers residual,hc,mhc --steps 9
    python benchmarks/step_bench.py --mode profile --mixers mhc --width 64 --depth 4 --heads 2 \
        --batch 16 --seq-len 64 --sum 'project_res/(closed_call/)?while'  # mHC's Sinkhorn loops
    python benchmarks/step_bench.py --mode compile --mixers mhc --depths 4 32 --width 64

Modes:

- ``time`` (here): median step time, tokens/s and achieved GFLOP/s per mixer and variant, next
  to the same process's dense-matmul rate, so every figure is a ratio.
- ``dots`` (step_dots.py): the step's dots alone, a ceiling on ``time``'s share of matmul.
- ``profile`` (step_profile.py): ``jax.profiler`` op time per place and part of the model.
- ``compile`` (step_compile.py): compile time against depth, scan against a Python loop.

``time``: variants ``scan`` (nn.scan, diagnostics off), ``loop`` (Python loop over blocks),
``diag`` (scan with the per-layer diagnostics on), ``bf16`` (scan, bfloat16 compute), and any of
these with config overrides after ``+`` (``scan+model.remat=full``: an A/B row in the same rounds
as the plain one). An override whose key starts with ``xla_`` is an XLA compiler option for that
row's executable instead (``scan+xla_cpu_prefer_vector_width=512``; ``:`` separates a list
value's items): XLA flags, which ``XLA_FLAGS`` sets only per process, compared in one process.
Model FLOPs are train_step.model_flops (mixer arithmetic not counted); ``xla_gflop`` is XLA's
own count of the compiled step. Every row is compiled first; then the rows are timed
round-robin, ``--steps`` rounds after ``--warmup`` untimed ones, each round one step of every row
and three dense matmuls; a row's time is its median over rounds and every ratio a median of the
same round's figures, so the VM's speed drifting during the run cancels out of them. Each row
also reports its median minor page faults and kernel CPU seconds per step. The accelerator check
(``benchmarks/gpu_check.sh``) adds ``--matmul-dtype bfloat16`` (MFU against the device's own
bf16 matmul), ``--attention BxHxTxD`` (attention's forward + backward alone, each
``model.attention`` formulation side by side, with XLA's count of each program's temporary
memory) and ``--json`` (everything, rewritten after each part); at the end a markdown table of
the rows with their ratio to residual.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import train_step
from timing import round_robin, timed
from train_step import MATMUL, matmul_fn, model_flops

from mhc_jax import mixers as registry
from mhc_jax.errors import ConfigError
from mhc_jax.model import layers
from mhc_jax.train.config import load_config

MODES = ("time", "dots", "profile", "compile")
VARIANTS = ("scan", "loop", "diag", "bf16")
DEFAULT_MIXERS = {
  "time": "residual,hc,mhc,mhc_lite",
  "dots": "residual",
  "profile": "mhc",
  "compile": "mhc",
}

ATTENTION_IMPLS = ("materialized", "xla", "jax_xla", "cudnn")


def sig(x: float, figures: int = 3) -> float:
  """``x`` to ``figures`` significant figures (a rate of a toy step is ~1e-4: decimals drop it)."""
  return float(f"{x:.{figures}g}")


def attention_fn(impl: str):
  """Causal attention ``[B, T, H, D] -> [B, T, H, D]`` as ``model.attention: impl`` computes
  it (mhc_jax/model/layers.py); ``jax_xla`` is ``jax.nn.dot_product_attention``'s own XLA form
  over the whole ``[T, T]`` scores, for reference."""
  sw = lambda a: jnp.swapaxes(a, -3, -2)
  if impl == "materialized":
    return lambda q, k, v: sw(layers.causal_attention(sw(q), sw(k), sw(v), False, q.dtype)[0])
  if impl == "xla":
    return layers.xla_attention
  if impl in ("jax_xla", "cudnn"):
    name = "xla" if impl == "jax_xla" else "cudnn"
    return lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation=name
    )
  raise ValueError(f"unknown attention {impl!r}; known: {', '.join(ATTENTION_IMPLS)}")


def attention_rows(
  shape: tuple, dtype, steps: int, warmup: int, impls=ATTENTION_IMPLS
) -> list[dict]:
  """Attention's forward + backward alone at ``shape = (B, H, T, D)``, each formulation of
  ``impls`` jitted (the loss ``sum(y)`` in float32, gradients for q, k and v) and timed
  round-robin: ``{"impl", "fwd_bwd_ms", "temp_mib", "tflop_per_s"}``, or ``{"impl", "error"}``
  for one this device cannot run (cuDNN off NVIDIA GPUs). FLOPs: the causal half of the dense
  score and value products, forward (4 B H T^2 D / 2) and backward (twice that)."""
  b, h, t, d = shape
  ks = jax.random.split(jax.random.PRNGKey(3), 3)
  q, k, v = (jax.random.normal(a, (b, t, h, d), dtype) for a in ks)
  rows, calls = {}, {}
  for impl in impls:
    f = attention_fn(impl)
    loss = lambda q, k, v, f=f: jnp.sum(f(q, k, v).astype(jnp.float32))
    try:
      exe = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, v).compile()
      jax.block_until_ready(exe(q, k, v))
    except Exception as e:  # e.g. no cuDNN here: the row says so
      rows[impl] = {"impl": impl, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
      continue
    mem = exe.memory_analysis()
    temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None
    rows[impl] = {"impl": impl, "temp_mib": None if temp is None else round(temp / 2**20, 2)}
    calls[impl] = lambda exe=exe: exe(q, k, v)
  flops = 3 * 4 * b * h * t * t * d / 2
  for impl, ts in round_robin(calls, steps, warmup).items():
    med = statistics.median(ts)
    rows[impl] |= {"fwd_bwd_ms": round(med * 1e3, 3), "tflop_per_s": sig(flops / med / 1e12)}
  return [rows[i] for i in impls]


def print_attention(rows: list[dict], shape: tuple, dtype) -> None:
  b, h, t, d = shape
  print(f"\nattention forward + backward, {b} x {h} heads x {t} x {d}, {jnp.dtype(dtype).name}:")
  ok = [r for r in rows if "fwd_bwd_ms" in r]
  base = next((r["fwd_bwd_ms"] for r in ok if r["impl"] == "materialized"), None)
  for r in rows:
    if "error" in r:
      print(f"  {r['impl']:>13}  not run: {r['error']}")
      continue
    vs = f"  {base / r['fwd_bwd_ms']:.2f}x materialized's speed" if base else ""
    print(
      f"  {r['impl']:>13}  {r['fwd_bwd_ms']:8.3f} ms  {r['tflop_per_s']:7.2f} TFLOP/s  "
      f"temp {r['temp_mib']} MiB{vs}"
    )


def print_table(rows: list[dict], matmul_dtype: str) -> None:
  """The rows as a markdown table: step, tokens/s, model TFLOP/s, MFU (of the reference matmul's
  rate in ``matmul_dtype``, same rounds) and the step's ratio to residual's (same variant)."""
  print(
    f"\n| mixer | variant | step | tokens/s | model TFLOP/s | MFU (vs {matmul_dtype} matmul) "
    "| vs residual |\n| --- | --- | --- | --- | --- | --- | --- |"
  )
  for r in rows:
    q = paired(rows, (r["mixer"], r["variant"]), ("residual", r["variant"]))
    print(
      f"| {r['mixer']} | {r['variant']} | {r['step_s'] * 1e3:.1f} ms | {r['tokens_per_s']:,.0f} "
      f"| {r['gflop_per_s'] / 1e3:.2f} | {100 * r['of_matmul_rate']:.1f}% "
      f"| {'' if q is None else f'{q:.2f}'} |"
    )


def prepare_row(base_overrides, mixer: str, variant: str) -> dict:
  """Build and compile one row: ``{"mixer", "variant", "cfg", "call", "compile_s", "xla_gflop"}``;
  ``call()`` runs one step (the state donated and carried in a box) and returns its loss."""
  kind, *extra = variant.split("+")  # "scan+KEY=VALUE": the scan row with more overrides
  extra, options = split_options(extra)
  ov = list(base_overrides) + [f"model.mixer={mixer}"]
  if kind == "loop":
    ov.append("model.scan=false")
  if kind == "bf16":
    ov.append("model.dtype=bfloat16")
  cfg = load_config(None, ov + extra)
  fn, state, batch = train_step.build(cfg, kind)
  t0 = time.perf_counter()
  exe = fn.lower(state, batch).compile(compiler_options=options or None)
  compile_s = time.perf_counter() - t0
  xla = exe.cost_analysis()
  xla = xla[0] if isinstance(xla, (list, tuple)) else xla
  box = [state]

  def call():
    box[0], metrics = exe(box[0], batch)
    return metrics["loss"]

  jax.block_until_ready(call())  # the first call (the executable is cached by now)
  return {
    "mixer": mixer,
    "variant": variant,
    "cfg": cfg,
    "call": call,
    "compile_s": round(compile_s, 2),
    "xla_gflop": sig(float(xla.get("flops", float("nan"))) / 1e9),
  }


def split_options(overrides: list[str]) -> tuple[list[str], dict]:
  """``(config overrides, XLA compiler options)``: ``KEY=VALUE`` items whose key starts with
  ``xla_`` are compiler options (config keys are ``section.field``); ``true`` / ``false``
  become booleans (XLA rejects a bool option given as a string), and ``:`` separates the items
  of a list value (``xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_ELTWISE:
  LIBRARY_FUSION_TYPE_REDUCE``), since ``,`` separates the variants."""
  options = dict(o.split("=", 1) for o in overrides if o.startswith("xla_") and "=" in o)
  options = {k: v.replace(":", ",") for k, v in options.items()}
  bools = {"true": True, "false": False}
  options = {k: bools.get(v.lower(), v) for k, v in options.items()}
  return [o for o in overrides if not (o.startswith("xla_") and "=" in o)], options


def interleave(
  rows: list[dict], steps: int, warmup: int, rate_calls: int = 3, mkn=MATMUL, dtype=jnp.float32
) -> list[dict]:
  """Time the rows round-robin: each round runs one step of every row, then the dense matmul
  ``rate_calls`` times. A row's step time is the median over rounds; its share of the matmul
  rate and its ratio to the first row are medians of the per-round figures, so a VM whose speed
  drifts or jumps during the run (this one's matmul rate moved 92-152 GFLOP/s between runs
  minutes apart) moves every row of a round together and leaves the ratios alone."""
  mm = matmul_fn(*mkn, dtype=dtype)
  rates = []  # GFLOP/s of the dense matmul, one per round

  def rate():
    rates.append(mm[1] / statistics.median(timed(mm[0]) for _ in range(rate_calls)) / 1e9)

  faults = [[] for _ in rows]  # (minor page faults, kernel seconds) per step

  def counted(i, call):
    def fn():
      r0 = resource.getrusage(resource.RUSAGE_SELF)
      out = jax.block_until_ready(call())
      r1 = resource.getrusage(resource.RUSAGE_SELF)
      faults[i].append((r1.ru_minflt - r0.ru_minflt, r1.ru_stime - r0.ru_stime))
      return out

    return fn

  calls = {i: counted(i, r["call"]) for i, r in enumerate(rows)}
  times = list(round_robin(calls, steps, warmup, rate).values())
  out = []
  for r, ts, fl in zip(rows, times, faults):
    b, t = r["cfg"].data.batch_size, r["cfg"].data.seq_len
    flops = model_flops(r["cfg"], b * t, t)
    med = statistics.median(ts)
    out.append(
      {
        "mixer": r["mixer"],
        "variant": r["variant"],
        "compile_s": r["compile_s"],
        "step_s": round(med, 4),
        "tokens_per_s": round(b * t / med, 1),
        "gflop_per_s": sig(flops / med / 1e9),
        "model_gflop": sig(flops / 1e9),
        "xla_gflop": r["xla_gflop"],
        "page_faults": int(statistics.median(f for f, _ in fl)),
        "kernel_s": round(statistics.median(k for _, k in fl), 3),
        "matmul_gflop_per_s": round(statistics.median(rates), 1),
        "of_matmul_rate": sig(statistics.median(flops / s / 1e9 / q for s, q in zip(ts, rates))),
        "times": [round(s, 4) for s in ts],
      }
    )
  return out


def paired(rows: list[dict], a: tuple, b: tuple) -> float | None:
  """Median over rounds of row ``a``'s step time over row ``b``'s (same round)."""
  by = {(r["mixer"], r["variant"]): r["times"] for r in rows}
  if a not in by or b not in by:
    return None
  return statistics.median(x / y for x, y in zip(by[a], by[b]))


def parse_args(argv):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--mode", default="time", choices=MODES)
  ap.add_argument("--mixers", default=None, help="comma list ('all': every registered mixer)")
  train_step.add_shape_args(ap, steps=5)
  t = ap.add_argument_group("--mode time")
  t.add_argument(
    "--variants",
    default="scan,loop,diag,bf16",
    help=f"comma list of {VARIANTS}; loop/diag/bf16 run for residual and mhc only "
    "unless --all-variants",
  )
  t.add_argument("--all-variants", action="store_true")
  t.add_argument(
    "--attention",
    default=None,
    metavar="BxHxTxD",
    help="first time attention's forward + backward alone, each implementation side by side",
  )
  t.add_argument("--attention-dtype", default="bfloat16", choices=("float32", "bfloat16"))
  t.add_argument("--json", default=None, help="also write the rows to this JSON file")
  p = ap.add_argument_group("--mode profile")
  p.add_argument("--diag", action="store_true", help="the step with per-layer diagnostics on")
  p.add_argument("--top", type=int, default=20)
  p.add_argument(
    "--diag-diff",
    action="store_true",
    help="then profile diagnostics off and on: the places whose op time grew most",
  )
  p.add_argument("--sum", default=None, help="also total the ops whose place ends with this regex")
  c = ap.add_argument_group("--mode compile")
  c.add_argument("--depths", type=int, nargs="+", default=[4, 32])
  c.add_argument("--repeats", type=int, default=3)
  c.add_argument("--no-loop", action="store_true", help="skip the Python-loop comparison")
  c.add_argument("--eager", type=int, default=0, help="first compile this many tiny programs")
  return ap.parse_args(argv)


def check(args) -> tuple[list[str], list[str], tuple]:
  """``(base overrides, mixers, matmul MxKxN)``; ValueError naming the option for bad input,
  before anything compiles."""
  mkn = train_step.parse_matmul(args.matmul)
  text = args.mixers or DEFAULT_MIXERS[args.mode]
  mixers = registry.names() if text == "all" else [m for m in text.split(",") if m]
  base = train_step.shape_overrides(args)
  try:
    load_config(None, base)
  except ConfigError as e:
    raise ValueError(f"--set: {e}") from None
  for m in mixers:
    try:
      load_config(None, base + [f"model.mixer={m}", *train_step.streams(m, args.n)])
    except ConfigError as e:
      raise ValueError(f"--mixers: {m}: {e}") from None
  if args.mode == "time":
    bad = sorted({v for v in args.variants.split(",") if v and v.split("+")[0] not in VARIANTS})
    if bad:
      raise ValueError(f"--variants: unknown {bad}; known: {', '.join(VARIANTS)}")
    for v in args.variants.split(","):
      try:
        load_config(None, base + split_options(v.split("+")[1:])[0])
      except ConfigError as e:
        raise ValueError(f"--set: {v}: {e}") from None
    if args.attention:
      try:
        shape = tuple(int(x) for x in args.attention.split("x"))
        assert len(shape) == 4 and min(shape) >= 1
      except (ValueError, AssertionError):
        raise ValueError(f"--attention: expected BxHxTxD, got {args.attention!r}") from None
  if args.mode == "compile" and min(args.depths) < 1:
    raise ValueError(f"--depths: expected positive integers, got {args.depths}")
  return base, mixers, mkn


def main(argv=None) -> int:
  args = parse_args(argv)
  try:  # bad input: one clear message before anything runs
    base, mixers, mkn = check(args)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(
    f"--mode {args.mode}  devices: {jax.devices()}  jax {jax.__version__}  "
    f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
  )
  if args.mode == "dots":
    import step_dots

    step_dots.run(args, base, mixers, mkn)
  elif args.mode == "profile":
    import step_profile

    step_profile.run(args, base, mixers)
  elif args.mode == "compile":
    import step_compile

    step_compile.run(args, base, mixers)
  else:
    time_rows(args, base, mixers, mkn, sys.argv[1:] if argv is None else argv)
  return 0


def time_rows(args, base: list[str], mixers: list[str], mkn: tuple, argv: list[str]) -> None:
  """``--mode time``: every (mixer, variant) row compiled, then timed round-robin."""
  variants = [v for v in args.variants.split(",") if v]
  att_shape = tuple(int(x) for x in args.attention.split("x")) if args.attention else None
  mm_dtype = jnp.dtype(args.matmul_dtype)
  rate = train_step.matmul_rate(mkn=mkn, dtype=mm_dtype)
  dev = jax.devices()[0]
  m, k, n = mkn
  print(f"dense matmul ({m}x{k} @ {k}x{n}, {mm_dtype.name}): {rate:.1f} GFLOP/s at start")
  report = {
    "jax": jax.__version__,
    "device": dev.device_kind,
    "platform": dev.platform,
    "matmul": {"mkn": list(mkn), "dtype": mm_dtype.name, "gflop_per_s_start": rate},
    "matmul_gflop_per_s_start": rate,
    "argv": list(argv),
  }

  def dump():
    if args.json:
      with open(args.json, "w") as f:
        json.dump(report, f, indent=1)

  if att_shape is not None:
    att_dtype = jnp.dtype(args.attention_dtype)
    att = attention_rows(att_shape, att_dtype, max(args.steps, 5), args.warmup)
    print_attention(att, att_shape, att_dtype)
    report["attention"] = {"shape_BHTD": list(att_shape), "dtype": att_dtype.name, "rows": att}
    dump()
  prepared = []
  for mixer in mixers:
    for variant in variants:
      if (
        not variant.startswith("scan")
        and mixer not in ("residual", "mhc")
        and not args.all_variants
      ):
        continue
      ov = base + train_step.streams(mixer, args.n)
      try:
        prepared.append(prepare_row(ov, mixer, variant))
      except Exception as e:  # a mixer that cannot run this shape: say so, keep going
        print(f"{mixer:>14} {variant:>5}  failed: {type(e).__name__}: {e}", flush=True)
  print(f"compiled {len(prepared)} rows; timing {args.steps} rounds (one step of each row a round)")
  rows = interleave(prepared, args.steps, args.warmup, mkn=mkn, dtype=mm_dtype)
  for row in rows:
    print(
      f"{row['mixer']:>14} {row['variant']:>5}  step {row['step_s']:.3f} s  "
      f"{row['tokens_per_s']:>9.0f} tok/s  {row['gflop_per_s']:6.1f} GFLOP/s "
      f"({100 * row['of_matmul_rate']:.0f}% of matmul)  compile {row['compile_s']:.1f} s  "
      f"{row['page_faults']} page faults, {row['kernel_s']:.2f} s in the kernel a step",
      flush=True,
    )
  print(
    f"matmul rate over the rounds: median {rows[0]['matmul_gflop_per_s'] if rows else 0} GFLOP/s"
  )
  print("\nratios (step time, median over rounds of the same round's ratio):")
  res = ("residual", "scan")
  pairs = [("residual scan / loop", res, ("residual", "loop"))]
  pairs += [(f"{m} diag on / off", (m, "diag"), (m, "scan")) for m in ("residual", "mhc")]
  pairs += [(f"{m} bf16 / f32", (m, "bf16"), (m, "scan")) for m in ("residual", "mhc")]
  pairs += [(f"{m} / residual (scan)", (m, "scan"), res) for m in ("hc", "mhc", "mhc_lite")]
  pairs += [
    (f"{m} / residual (bf16)", (m, "bf16"), ("residual", "bf16")) for m in ("hc", "mhc", "mhc_lite")
  ]
  pairs += [
    (f"{r['mixer']} {r['variant']} / scan", (r["mixer"], r["variant"]), (r["mixer"], "scan"))
    for r in rows
    if "+" in r["variant"]
  ]
  for name, x, y in pairs:
    q = paired(rows, x, y)
    if q is not None:
      print(f"  {name}: {q:.2f}")
  print_table(rows, mm_dtype.name)
  report["rows"] = rows
  dump()


if __name__ == "__main__":
  sys.exit(main())
