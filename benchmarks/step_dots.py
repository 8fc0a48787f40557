"""``step_bench.py --mode dots``: the train step's dots alone. How fast could the step be if
everything but its matrix products took no time? An upper bound on ``--mode time``'s "of matmul"
share at a shape.

The dots are read from the compiled step itself (with ``model.scan=false``, so every dot XLA runs
appears once in the optimised HLO, with no loop to count through): each ``dot`` instruction's
operand shapes and dimension numbers, whichever fusion holds it. Each distinct dot is then jitted
alone as a ``lax.dot_general`` on random operands of those shapes and timed round-robin with the
reference matmul (a dot's time is its median over rounds, its rate a median of the same round's
ratios to the reference, so the VM's drift cancels). The dot-only step is the sum over dots of
count x time, and

    ceiling = model FLOPs / dot-only step time / reference matmul rate

is the largest "of matmul" share the step could reach if every other op (norms, softmax, GELU,
the mixers, the optimiser) were free. A small dot's time includes one dispatch of a jitted call
(``dispatch``, a jitted scalar add, is timed in the same rounds), so the ceiling is printed as
timed and less one dispatch per dot. With residual among ``--mixers``, each mixer's dots-alone
time over residual's is a floor under its step ratio. docs/performance.md ("The dots alone") has
the figures.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from typing import NamedTuple

import jax
import numpy as np
import train_step
from jax import lax
from timing import round_robin

from mhc_jax.train.config import load_config

_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[([\d,]*)\]")
_DOT = re.compile(r"\bdot\(\s*%?([\w.\-]+),\s*%?([\w.\-]+)\s*\)(.*)$")
_DIMS = re.compile(
  r"(lhs_batch_dims|lhs_contracting_dims|rhs_batch_dims|rhs_contracting_dims)=\{([\d,]*)\}"
)


class Dot(NamedTuple):
  """One dot's operands and dimension numbers (as XLA's ``dot`` instruction has them)."""

  dtype: str
  lhs: tuple
  rhs: tuple
  lhs_batch: tuple = ()
  lhs_contract: tuple = ()
  rhs_batch: tuple = ()
  rhs_contract: tuple = ()

  @property
  def flops(self) -> int:
    """2 x (output elements) x (contracted length)."""
    free_l = [d for i, d in enumerate(self.lhs) if i not in self.lhs_batch + self.lhs_contract]
    free_r = [d for i, d in enumerate(self.rhs) if i not in self.rhs_batch + self.rhs_contract]
    batch = [self.lhs[i] for i in self.lhs_batch]
    k = [self.lhs[i] for i in self.lhs_contract]
    return 2 * int(np.prod(batch + free_l + free_r + k, dtype=np.int64))

  def label(self) -> str:
    """``[b] m x k @ k x n`` style, with the batch and the free dims multiplied out."""
    b = int(np.prod([self.lhs[i] for i in self.lhs_batch], dtype=np.int64))
    k = int(np.prod([self.lhs[i] for i in self.lhs_contract], dtype=np.int64))
    m = int(np.prod(self.lhs, dtype=np.int64)) // (b * k)
    n = int(np.prod(self.rhs, dtype=np.int64)) // (b * k)
    dims = (
      f"lhs{list(self.lhs)} rhs{list(self.rhs)} contracting {self.lhs_contract}/{self.rhs_contract}"
    )
    return f"{self.dtype} " + (f"{b} x " if b > 1 else "") + f"{m}x{k} @ {k}x{n}  ({dims})"


def hlo_dots(text: str) -> Counter:
  """``Counter({Dot: count})`` of the ``dot`` instructions in an HLO module's text. Instruction
  names are unique in a module, so one name -> shape map serves every computation."""
  shapes, dots = {}, []
  for line in text.splitlines():
    m = _DEF.match(line)
    if not m:
      continue
    name, dtype, dims = m.groups()
    shapes[name] = (dtype, tuple(int(d) for d in dims.split(",") if d))
    d = _DOT.search(line)
    if d:
      dots.append(d.groups())
  out = Counter()
  for a, b, attrs in dots:
    nums = {k: tuple(int(x) for x in v.split(",") if x) for k, v in _DIMS.findall(attrs)}
    out[
      Dot(
        shapes[a][0],
        shapes[a][1],
        shapes[b][1],
        nums.get("lhs_batch_dims", ()),
        nums.get("lhs_contracting_dims", ()),
        nums.get("rhs_batch_dims", ()),
        nums.get("rhs_contracting_dims", ()),
      )
    ] += 1
  return out


def dot_call(d: Dot):
  """A jitted ``lax.dot_general`` of ``d``'s shapes on random operands: a no-argument call."""
  dt = {"f32": np.float32, "bf16": jax.numpy.bfloat16, "f16": np.float16}[d.dtype]
  x = jax.random.normal(jax.random.PRNGKey(0), d.lhs, dt)
  y = jax.random.normal(jax.random.PRNGKey(1), d.rhs, dt)
  nums = ((d.lhs_contract, d.rhs_contract), (d.lhs_batch, d.rhs_batch))
  f = jax.jit(lambda a, b: lax.dot_general(a, b, nums))
  jax.block_until_ready(f(x, y))
  return lambda: f(x, y)


def time_dots(dot_sets: list[Counter], steps: int, warmup: int, extra: dict | None = None) -> dict:
  """``{Dot or name: [seconds per round]}``: every distinct dot of ``dot_sets``, a jitted scalar
  add (``"dispatch"``) and the ``extra`` calls, timed round-robin (timing.round_robin)."""
  one = jax.numpy.zeros(())
  add = jax.jit(lambda a: a + 1)
  calls = dict(extra or {}, dispatch=lambda: add(one))
  for dots in dot_sets:
    calls.update({d: dot_call(d) for d in dots if d not in calls})
  return round_robin(calls, steps, warmup)


def alone_per_round(dots: Counter, times: dict, net: bool = False) -> list[float]:
  """Each round's sum of count x time over ``dots``; ``net``: less one dispatch per dot."""
  disp = times["dispatch"]
  return [
    sum(c * (max(times[d][i] - disp[i], 0.0) if net else times[d][i]) for d, c in dots.items())
    for i in range(len(disp))
  ]


def mixer_dots(base: list[str], mixer: str, n: int) -> tuple[Counter, float]:
  """``(Counter({Dot: count}), model FLOPs)`` of one mixer's compiled step."""
  # model.scan=false: every dot once in the HLO, no while loop to count through
  # train.diag_every=0: no non-finite localisation branch (a lax.cond that re-runs the forward and
  # backward only on a non-finite step) whose dots would be counted as if every step ran them
  extra = [f"model.mixer={mixer}", *train_step.streams(mixer, n), "model.scan=false"]
  extra.append("train.diag_every=0")
  cfg = load_config(None, base + extra)
  fn, state, batch = train_step.build(cfg)
  tokens = cfg.data.batch_size * cfg.data.seq_len
  return hlo_dots(fn.lower(state, batch).compile().as_text()), train_step.model_flops(
    cfg, tokens, cfg.data.seq_len
  )


def run(args, base: list[str], mixers: list[str], mkn: tuple) -> None:
  """The dots of each mixer's step, timed alone; the ceiling; each mixer's dots over residual's."""
  per = {m: mixer_dots(base, m, args.n) for m in mixers}
  ref, ref_flops = train_step.matmul_fn(*mkn)
  times = time_dots([d for d, _ in per.values()], args.steps, args.warmup, {"ref": ref})
  rates = [ref_flops / t for t in times["ref"]]  # FLOP/s of the reference, per round
  print(f"reference matmul {'x'.join(map(str, mkn))}: {statistics.median(rates) / 1e9:.1f} GFLOP/s")
  print(
    f"dispatch of a jitted scalar add: {statistics.median(times['dispatch']) * 1e6:.0f} us "
    "(in every dot's time)"
  )
  alone = {}
  for m, (dots, model) in per.items():
    executed = sum(d.flops * c for d, c in dots.items())
    print(
      f"\n{m}: {sum(dots.values())} dots in the compiled step ({len(dots)} distinct), "
      f"{executed / 1e9:.2f} GFLOP executed; model FLOPs {model / 1e9:.2f} GFLOP"
    )
    print("  ms/step  count  GFLOP/s  of ref  dot")
    rows = sorted(((c * statistics.median(times[d]), d, c) for d, c in dots.items()), reverse=True)
    for total, d, c in rows:
      share = statistics.median(d.flops / a / r for a, r in zip(times[d], rates))
      print(
        f"{total * 1e3:9.1f}  {c:5d}  {d.flops * c / total / 1e9:7.1f}  {share:6.2f}  {d.label()}"
      )
    for name, net in (("as timed", False), ("less one dispatch per dot", True)):
      step = alone_per_round(dots, times, net)
      alone[m, name] = step
      ceiling = statistics.median(model / s / r for s, r in zip(step, rates) if s > 0)
      print(
        f"  dots alone, {name}: {statistics.median(step) * 1e3:.0f} ms a step; ceiling of "
        f"the step's share: {ceiling:.2f} of the reference matmul"
      )
  if "residual" in mixers:
    for m in mixers:
      if m != "residual":
        q = statistics.median(
          a / b for a, b in zip(alone[m, "as timed"], alone["residual", "as timed"])
        )
        print(f"{m} / residual, dots alone (as timed): {q:.2f}")
