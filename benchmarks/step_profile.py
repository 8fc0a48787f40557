"""``step_bench.py --mode profile``: where one train step's time goes. ``jax.profiler`` over a few
steps, summed per compiled op (fusion, while loop, dot), with the op's place in the model from the
HLO metadata.

Prints each mixer's median step time of ``--steps`` timed steps after ``--warmup`` ones, then the
``--top`` ops by time per step: a ``while`` op's time includes the ops inside it (nested loops,
such as the Sinkhorn iterations inside the scan over blocks, are listed again on their own). Then
the op time summed by part of the model (``PARTS``: Sinkhorn, attention and MLP, the mixer's own
ops, the scan's per-layer slicing, the rest), loops left out so nothing counts twice, and how much
of it sits in fusions that hold a dynamic slice (``sliced_fusions``). ``--diag-diff`` then
profiles the step with diagnostics off and on and lists the places whose op time grew most.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import re
import statistics
import tempfile
import time

import jax
import train_step

from mhc_jax.train.config import load_config

# Where an op belongs, by its place in the model (first match wins). ``while`` ops are left out of
# the breakdown: a loop's time is the time of the ops inside it, which are counted themselves.
PARTS = (
  ("Sinkhorn projection", r"project_res"),
  ("attention and MLP (with their norms)", r"/(attn|mlp)(_norm)?/"),
  ("mixer (coefficients, stream read and mix)", r"(attn|mlp)_mix"),
  ("scan stacking (per-layer slices)", r"dynamic_(update_)?(index_in_dim|slice)"),
  ("rest (embedding, head, loss, optimiser)", r""),
)


def _short(place: str) -> str:
  return re.sub(r"^jit\([^)]*\)/", "", place)


def part_of(place: str) -> str:
  return next(name for name, pattern in PARTS if re.search(pattern, place))


def op_places(hlo: str) -> dict[str, str]:
  """``{op name: op_name metadata}`` of every instruction in the compiled HLO text."""
  out = {}
  for m in re.finditer(r"%?([\w.\-]+) = .*?metadata=\{op_name=\"([^\"]*)\"", hlo):
    out[m.group(1)] = m.group(2)
  return out


def sliced_fusions(hlo: str) -> set[str]:
  """Names of the fusions whose fused computation holds a ``dynamic-slice``: under ``nn.scan``,
  the backward's reads of each layer's saved values out of ``[L, ...]`` stacks, fused into the
  element-wise op that consumes them (benchmarks/layer_bench.py times the cost)."""
  sliced = {
    m.group(1)
    for m in re.finditer(r"^%([\w.\-]+) \(.*?^}$", hlo, re.S | re.M)
    if "dynamic-slice(" in m.group(0)
  }
  return {
    m.group(1)
    for m in re.finditer(r"%([\w.\-]+) = \S+ fusion\(.*?calls=%([\w.\-]+)", hlo)
    if m.group(2) in sliced
  }


def op_times(step, hlo: str, traced: int = 5):
  """``(ms per step, calls per step, places)`` of each compiled op of ``hlo`` over ``traced``
  calls of ``step`` under ``jax.profiler`` (host-side frames and executor spans left out)."""
  places = op_places(hlo)
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      for _ in range(traced):
        step()
    (path,) = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)
    events = json.load(gzip.open(path))["traceEvents"]
  total, calls = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and e.get("name") in places:
      total[e["name"]] += e["dur"] / traced / 1e3
      calls[e["name"]] += 1
  return total, collections.Counter({k: v // traced for k, v in calls.items()}), places


def print_parts(total, places, sliced=frozenset()) -> None:
  """The op time of ``op_times`` summed by part of the model (``PARTS``; loops left out)."""
  parts = collections.Counter()
  for place, ms in by_place(total, places).items():
    parts[part_of(place)] += ms
  whole = sum(parts.values())
  print(f"op time by part of the model ({whole:.0f} ms of ops a step: the CPU runs some at once)")
  for name, _ in PARTS:
    print(f"{parts[name]:8.1f} ms  {100 * parts[name] / whole:4.1f}%  {name}")
  ms = sum(v for name, v in total.items() if name in sliced)
  print(f"{ms:8.1f} ms  {100 * ms / whole:4.1f}%  of it in fusions holding a dynamic slice")


def by_place(total, places) -> collections.Counter:
  """The op time of ``op_times`` summed per place in the model (loops left out, as in
  ``print_parts``): ops of one place, e.g. the fusions of one jnp call, count together."""
  out = collections.Counter()
  for name, ms in total.items():
    if not name.startswith("while"):
      out[_short(places[name])] += ms
  return out


def print_place_diff(off, on, top: int) -> None:
  """The ``top`` places whose op time grew most from ``off`` to ``on`` (``by_place`` counters)."""
  grew = collections.Counter({k: on[k] - off[k] for k in set(off) | set(on)})
  print(f"op time a step: {sum(off.values()):.0f} ms off, {sum(on.values()):.0f} ms on")
  print(f"{'+ms':>8} {'off':>8} {'on':>8}  place in the model")
  for place, ms in grew.most_common(top):
    print(f"{ms:8.2f} {off[place]:8.2f} {on[place]:8.2f}  {place[-100:]}")


def run(args, base: list[str], mixers: list[str]) -> None:
  """Profile each mixer's step (``args``: steps, warmup, diag, top, sum, diag_diff, n)."""
  for mixer in mixers:
    cfg = load_config(None, base + [f"model.mixer={mixer}", *train_step.streams(mixer, args.n)])
    wanted = {args.diag, False, True} if args.diag_diff else {args.diag}
    built = {d: train_step.build(cfg, "diag" if d else "scan") for d in wanted}

    def step(diag=args.diag):
      fn, state, batch = built[diag]
      state, m = fn(state, batch)
      built[diag] = (fn, state, batch)
      jax.block_until_ready(m["loss"])

    def hlo(diag=args.diag) -> str:
      fn, state, batch = built[diag]
      return fn.lower(state, batch).compile().as_text()

    times = []
    for i in range(args.warmup + args.steps):
      t0 = time.perf_counter()
      step()
      if i >= args.warmup:
        times.append(time.perf_counter() - t0)
    med = statistics.median(times) * 1e3
    print(f"{mixer}{' (diagnostics on)' * args.diag}: median step {med:.1f} ms")
    text = hlo()
    total, calls, places = op_times(step, text)
    print(f"{'ms/step':>8} {'calls':>6}  op  (place in the model)")
    for name, ms in total.most_common(args.top):
      print(f"{ms:8.2f} {calls[name]:6d}  {name}  ({_short(places[name])[-90:]})")
    print_parts(total, places, sliced_fusions(text))
    if args.sum:
      hit = [n for n in total if re.search(f"(?:{args.sum})$", places[n])]
      ms = sum(total[n] for n in hit)
      print(f"ops whose place ends with {args.sum!r}: {len(hit)}, {ms:.1f} ms per step")
    if args.diag_diff:
      diag_places = []
      for diag in (False, True):
        for _ in range(args.warmup + 1):  # compiled and warm
          step(diag)
        diag_places.append(by_place(*op_times(lambda d=diag: step(d), hlo(diag))[::2]))
      print("-- diagnostics off -> on, one process")
      print_place_diff(*diag_places, args.top)
