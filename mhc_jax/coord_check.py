"""``mhc-jax coord-check MIXER``: microsoft/mup's coordinate check (CompleteP, arXiv:2505.01618,
for depth): per block, activation and update RMS after a few steps against width and depth, and
a verdict per quantity. The quantities and the rule: docs/statistics.md, "Coordinate checks"."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from mhc_jax.diagnostics import tree_layer_norms
from mhc_jax.errors import UsageError
from mhc_jax.train.config import config_hash, load_config
from mhc_jax.train.loop import SingleProgram, prepare

#: |log-log slope| above which a quantity grows (shrinks) with size: 2^0.25 = 1.19x per doubling.
SLOPE_TOL = 0.25
COLUMNS = ["axis", "width", "depth", "layer", "quantity", "step", "value"]
#: The check's own settings (a constant lr from the first step); --set may change them.
FIXED = ("model.scan=true", "optim.warmup_steps=0", "optim.schedule=constant", "train.diag_every=0")


def measure(setup, steps: int) -> list[tuple]:
  """``(layer, quantity, step, value)`` on batch 0 after ``step = 0..steps`` updates (one device)."""
  program = SingleProgram(setup)
  state, x = program.init(), program.batch(0)["inputs"]
  L = setup.cfg.model.depth

  @jax.jit  # one forward: the stream leaving each block [L, elements] and the logit max [L]
  def forward(p):
    (_, stats), sown = program.model.apply(p, x, mutable=["intermediates"])
    stream = sown["intermediates"]["blocks"]["stream"][0].reshape(L, -1)
    return stream.astype(jnp.float32), stats["attn_logit_max"]

  rms = lambda a: jnp.sqrt(jnp.mean(jnp.square(a), axis=1))
  p0, (s0, _) = jax.device_get(state.params["params"]["blocks"]), forward(state.params)
  per_block = sum(a[0].size for a in jax.tree.leaves(p0))
  rows = []
  for t in range(steps + 1):
    if t:
      state, _ = program.step(state, None, t - 1, False)  # donates the old state
    (s, attn_max), blocks = forward(state.params), state.params["params"]["blocks"]
    dp = tree_layer_norms(jax.tree.map(jnp.subtract, blocks, p0)) / np.sqrt(per_block)
    quantities = [("act_rms", rms(s)), ("act_delta_rms", rms(s - s0)), ("param_delta_rms", dp)]
    for q, v in [*quantities, ("attn_logit_max", attn_max)]:
      rows += [(layer, q, t, float(val)) for layer, val in enumerate(np.asarray(v))]
  return rows


def run(make_cfg, widths, depths, steps: int, progress: bool = True) -> pd.DataFrame:
  """The CSV's rows. ``make_cfg(width, depth)``: the config at a size (None: the base's, so widths
  go at its depth and depths at its width); every size is checked before any trains."""
  plan = [("width", w, None) for w in widths] + [("depth", None, d) for d in depths]
  plan = [(axis, prepare(make_cfg(w, d), devices=jax.devices()[:1])) for axis, w, d in plan]
  rows, done = [], {}  # the base size sits on both axes: measured once
  for axis, setup in tqdm(plan, desc="coord-check", disable=not progress, file=sys.stderr):
    m, key = setup.cfg.model, config_hash(setup.cfg)
    done[key] = done.get(key) or measure(setup, steps)
    rows += [(axis, m.width, m.depth, *r) for r in done[key]]
  return pd.DataFrame(rows, columns=COLUMNS)


def _last(df: pd.DataFrame) -> pd.DataFrame:
  """The last block's rows (the stream the output reads) at the last step."""
  return df[(df.step == df.step.max()) & (df.layer == df.depth - 1)]


def verdicts(df: pd.DataFrame) -> pd.DataFrame:
  """Per axis and quantity: the log-log slope against size of the last block's value at the last
  step, and ``growing`` (slope > SLOPE_TOL), ``shrinking`` (< -SLOPE_TOL) or ``flat``."""
  out = []
  for (axis, q), g in _last(df).groupby(["axis", "quantity"], sort=False):
    y = g.groupby(axis)["value"].mean()  # one row per size
    slope, word = np.nan, "undefined (non-finite or zero values)"
    if np.isfinite(y).all() and (y > 0).all():
      slope = float(np.polyfit(np.log(y.index.to_numpy(float)), np.log(y.to_numpy()), 1)[0])
      word = "growing" if slope > SLOPE_TOL else "shrinking" if slope < -SLOPE_TOL else "flat"
    out.append((axis, q, slope, word))
  return pd.DataFrame(out, columns=["axis", "quantity", "slope", "verdict"])


def _decade(ax, values: np.ndarray) -> None:
  """Log y limits spanning at least a decade around the values, so flat reads as flat."""
  v = values[np.isfinite(values) & (values > 0)]
  if v.size:
    lo, hi = np.log10(v.min()), np.log10(v.max())
    pad = max(0.0, 1.0 - (hi - lo)) / 2 + 0.05
    ax.set_ylim(10 ** (lo - pad), 10 ** (hi + pad))


def plot(df: pd.DataFrame, path) -> None:
  """microsoft/mup's coordinate-check figure: a row per quantity, a column per axis and
  parametrisation (sp beside the chosen one where both ran, same y range), log-log axes spanning
  at least a decade; one line per block (against depth: the first, middle and last block) and
  per step 1..T (lighter = earlier)."""
  import matplotlib.pyplot as plt

  df = df if "parametrization" in df else df.assign(parametrization="")
  qs, pars = list(dict.fromkeys(df.quantity)), list(dict.fromkeys(df.parametrization))
  cols = [(a, p) for a in ("width", "depth") for p in pars if (df.axis == a).any()]
  steps = sorted(t for t in df.step.unique() if t > 0) or [0]
  fig, axes = plt.subplots(len(qs), len(cols), figsize=(3.6 * len(cols), 2.8 * len(qs)))
  axes = np.asarray(axes).reshape(len(qs), len(cols))
  cmap = plt.get_cmap("viridis")
  for i, q in enumerate(qs):
    row = df[(df.quantity == q) & df.step.isin(steps)]
    for j, (axis, par) in enumerate(cols):
      ax, d = axes[i, j], row[(row.axis == axis) & (row.parametrization == par)]
      key = d.layer
      if axis == "depth":  # blocks differ in number: the first, middle and last (0, 0.5, 1)
        d = d[(d.layer == 0) | (d.layer == d.depth // 2) | (d.layer == d.depth - 1)]
        key = np.select([d.layer == d.depth - 1, d.layer == 0], [1.0, 0.0], 0.5)
      for (k, t), g in d.groupby([key, "step"]):
        c = cmap(0.9 * (k if axis == "depth" else k / max(d.layer.max(), 1)))
        alpha = 0.3 + 0.7 * (steps.index(t) + 1) / len(steps)
        ax.plot(g[axis], g["value"], "o-", ms=3, lw=1, color=c, alpha=alpha)
      ax.set_xscale("log", base=2)
      ax.set_yscale("log")
      _decade(ax, row[row.axis == axis]["value"].to_numpy(float))
      ax.set(xlabel=axis, title=f"{q} - {par or 'run'}".rstrip(" -"))
  fig.suptitle(
    f"coordinate check: a line per block (colour: first -> last) and step {steps[0]}..{steps[-1]} "
    "(lighter = earlier); flat = width/depth-independent",
    fontsize=9,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _sizes(flag: str, text: str) -> list[int]:
  sizes = sorted({int(v) for v in text.split(",")}) if re.fullmatch(r"\d+(,\d+)+", text) else []
  if len(sizes) < 2 or sizes[0] < 1:
    raise UsageError(f"{flag}: expected two or more comma-separated integers >= 1, got {text!r}")
  return sizes


def main(args) -> int:
  widths, depths = _sizes("--widths", args.widths), _sizes("--depths", args.depths)
  if (out := Path(args.out)).exists():
    raise UsageError(f"--out: {out} exists; coord-check never overwrites, name a new directory")
  # the base sizes stay the smallest checked (unless --set), so the multipliers change with size
  par = [f"model.base_width={widths[0]}", f"model.base_depth={depths[0]}"]
  par += [f"model.parametrization={args.parametrization}"] if args.parametrization else []
  base = [*FIXED, f"model.mixer={args.mixer}", f"train.steps={args.steps}", *par, *args.set]
  size = lambda k, v: [f"model.{k}={v}"] if v else []
  maker = lambda extra: (
    lambda w, d: load_config(args.config, [*base, *extra, *size("width", w), *size("depth", d)])
  )
  m = maker([])(None, None).model
  # beside sp, so that flat reads against what grows (microsoft/mup's figure)
  pars = [m.parametrization] + (["sp"] if m.parametrization != "sp" else [])
  frames = []
  for par in pars:
    make = maker([f"model.parametrization={par}"])
    frames.append(run(make, widths, depths, args.steps, progress=not args.quiet))
    frames[-1].insert(0, "parametrization", par)
  print(f"{args.mixer} under {m.parametrization} (base width {m.base_width}, depth {m.base_depth})")
  out.mkdir(parents=True)
  df = pd.concat(frames, ignore_index=True)
  df.to_csv(out / "coord_check.csv", index=False)
  plot(df, out / "coord_check.png")
  for par, frame in zip(pars, frames):
    tag = "" if par == m.parametrization else f" [{par}]"
    for r in verdicts(frame).itertuples():
      print(f"{args.mixer} {r.quantity} against {r.axis}: {r.verdict} (slope {r.slope:+.2f}){tag}")
  print(f"coord check: {out}/coord_check.csv, {out}/coord_check.png")
  return 0
