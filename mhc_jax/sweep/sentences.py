"""The report's sentence: ONE plain sentence saying what differs between the mixers, computed
from a summary table by rules tried in order (divergence, learning, growth of the composite gain,
spikes, loss); the rules and thresholds: docs/statistics.md ("The sentence under the table").
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from mhc_jax.sweep import report_tables as tables, stats
from mhc_jax.sweep.lrmap import endpoint_of as _endpoint
from mhc_jax.sweep.stats import _floats as _num

#: Thresholds of :func:`finding` (docs/statistics.md, "The sentence under the table").
FINDING_RULES = {
  "learned_ratio": 0.25,  # learned: mean KL at most this fraction of the worst mixer's ...
  "learned_gap_bits": 0.1,  # ... and at least this many bits below it
  "growth_ratio": 1.5,  # a composite gain grew: deepest / shallowest >= this
  "flat_ratio": 1.2,  # ... and another's stayed: max / min over depths <= this
  "loss_rel_gap": 0.03,  # losses differ: relative gap at least 3%
}


def _finite(d: pd.DataFrame, col: str) -> np.ndarray:
  v = _num(d[col]) if col in d.columns else np.zeros(0)
  return v[np.isfinite(v)]


def _g(v: float) -> str:
  """A number for a sentence: 3 significant digits, plain notation where reasonable."""
  if math.isfinite(v) and v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
    return f"{v:.2g}"
  return f"{v:.3g}" if math.isfinite(v) else tables._fmt(v)


def _band(lo: float, hi: float) -> str:
  """ "1.00–1.02": both ends with the decimals that tell them apart (2 to 4)."""
  if abs(hi) >= 1e4 or abs(lo) >= 1e4:
    return f"{_g(lo)}–{_g(hi)}" if _g(lo) != _g(hi) else _g(lo)
  dec = next((k for k in range(2, 5) if f"{lo:.{k}f}" != f"{hi:.{k}f}"), None)
  return f"{lo:.{dec}f}–{hi:.{dec}f}" if dec else f"{lo:.2f}"


def _join(names: list[str]) -> str:
  return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def finding(df: pd.DataFrame) -> str:
  """ONE plain sentence saying what differs between the mixers, computed from a
  :func:`summary_table`; its rules, in order, are in docs/statistics.md."""
  d = df[df["steps"] > 0] if "steps" in df.columns else df
  if not len(d):
    return "No run has logged metrics yet, so there is nothing to compare."
  options = tables._option_columns(df)
  d = d.assign(mixer=tables.arm_labels(d, options)) if "mixer" in d.columns else d
  if "mixer" not in d.columns or d["mixer"].nunique() < 2:
    m = str(d["mixer"].iloc[0]) if "mixer" in d.columns else "one configuration"
    loss = _finite(d, "final_loss")
    tail = f" (final loss {_band(loss.min(), loss.max())})" if loss.size else ""
    return f"Only one mixer ({m}) has results{tail}, so there is no comparison between mixers."
  order = tables._mixer_order(d["mixer"])
  varies = lambda c: c in d.columns and d[c].map(stats._key).nunique() > 1  # noqa: E731
  ctx = [c for c in tables.group_columns(df) if c != "mixer" and c not in options and varies(c)]
  for rule in (_divergence, _learning, _growth, _spikes):
    if text := rule(d, order, ctx):
      return text + "."
  return (_loss(df, d, ctx) or _no_difference(d)) + "."


def _groups(d: pd.DataFrame, ctx: list[str]) -> list[tuple[tuple, pd.DataFrame]]:
  """``d`` split by the ``ctx`` columns, largest values first (deepest, widest)."""

  def rank(key: tuple) -> tuple:
    return tuple((-x if np.isfinite(x) else math.inf, str(v)) for x, v in zip(_num(key), key))

  return sorted(stats.split(d, ctx), key=lambda kv: rank(kv[0]))


def _label(ctx: list[str], key: tuple) -> str:
  """ "depth 8 and width 32" for a group."""
  num = lambda v: isinstance(v, (int, float, np.number)) and not isinstance(v, bool)  # noqa: E731
  return _join([f"{c} {_g(float(v)) if num(v) else v}" for c, v in zip(ctx, key)]) if ctx else ""


def _head(ctx: list[str], key: tuple) -> str:
  return f"At {_label(ctx, key)}, " if ctx else ""


def _divergence(d, order, ctx) -> str | None:
  bad = d.assign(_bad=~np.isfinite(_num(d["final_loss"])))
  counts = {m: (int(g["_bad"].sum()), len(g)) for m, g in bad.groupby("mixer")}
  if not any(k for k, _ in counts.values()) or len({k / n for k, n in counts.values()}) == 1:
    return None
  parts = []
  for m in [m for m in order if counts[m][0]]:
    where = [_label(ctx, k) for k, g in _groups(bad[bad["mixer"] == m], ctx) if g["_bad"].any()]
    at = f" ({'; '.join(where)})" if ctx and where else ""
    parts.append(f"{m} diverged in {counts[m][0]} of {counts[m][1]} runs{at}")
  clean = [m for m in order if not counts[m][0]]
  return _join(parts) + (f" while {_join(clean)} never did" if clean else "")


def _learning(d, order, ctx) -> str | None:
  r = FINDING_RULES
  for key, g in _groups(d, ctx) if "kl_bits" in d.columns else []:
    kl = {m: _num(gm["kl_bits"]) for m, gm in g.groupby("mixer")}
    mean = {m: float(np.mean(v)) for m, v in kl.items() if v.size and np.isfinite(v).all()}
    worst, best = max(mean.values(), default=0), min(mean.values(), default=0)
    if len(mean) < 2 or best > r["learned_ratio"] * worst or worst - best < r["learned_gap_bits"]:
      continue
    bar = min(r["learned_ratio"] * worst, worst - r["learned_gap_bits"])
    ranked = sorted((m for m in order if m in mean), key=lambda m: mean[m])
    n_ok = {m: int((kl[m] <= bar).sum()) for m in ranked}
    bits = lambda ms: _join([_g(mean[m]) for m in ms])  # noqa: E731
    if max(len(kl[m]) for m in ranked) == 1:  # one run each: learned or not
      good = [m for m in ranked if n_ok[m]]
      poor = [m for m in ranked if not n_ok[m] and mean[m] >= 0.75 * worst]
      mid = [m for m in ranked if m not in good and m not in poor]
      text = (
        f"{_head(ctx, key)}{_join(good)} learned the task (KL {bits(good)} bits to the exact "
        f"posterior) while {_join(poor)} did not ({bits(poor)} bits)"
      )
      return text + (f", with {_join(mid)} in between ({bits(mid)} bits)" if mid else "")
    first, rest = ranked[0], ranked[1:]
    others = [f"{m} in {n_ok[m]} of {len(kl[m])} (mean {_g(mean[m])} bits)" for m in rest]
    return (
      f"{_head(ctx, key)}{first} learned the task in {n_ok[first]} of {len(kl[first])} runs "
      f"(mean KL {_g(mean[first])} bits to the exact posterior), " + _join(others)
    )
  return None


def _growth(d, order, ctx) -> str | None:
  rest_ctx = [c for c in ctx if c != "depth"]
  for key, g in _groups(d, rest_ctx) if "depth" in ctx else []:
    if text := _growth_in(g.assign(_depth=_num(g["depth"])), order):
      return _head(rest_ctx, key) + text
  return None


def _grown(d: pd.DataFrame, col: str) -> tuple | None:
  """(ratio, table of geometric means over seeds [mixer x depth], shallowest, deepest, ratios)
  of ``col`` where some mixer's grew by the growth ratio; None where none did."""
  v = d.assign(_v=_num(d[col])).groupby(["mixer", "_depth"])["_v"]
  tab = v.apply(lambda x: stats.mean_ci(x, log=True)[0]).unstack()
  tab = tab[[c for c in tab.columns if np.isfinite(c)]]
  if tab.shape[1] < 2:
    return None
  lo, hi = min(tab.columns), max(tab.columns)
  ok = tab[np.isfinite(tab[lo]) & np.isfinite(tab[hi]) & (tab[lo] > 0)]
  ratio = ok[hi] / ok[lo]
  r = FINDING_RULES["growth_ratio"]
  if len(ok) < 2 or ratio.max() < r or ok.loc[ratio.idxmax(), hi] < r:
    return None
  return ratio.max(), ok, lo, hi, ratio


def _growth_in(d: pd.DataFrame, order: list[str]) -> str | None:
  """The growth rule within one group: geometric means over seeds per mixer and depth; the
  per-token measure where it shows the growth, forward or backward, whichever grew more."""
  for kind, suffix in (("per-token", "_tok_mean_max"), ("token-averaged", "_max")):
    found = [
      (*g, direction)
      for short, direction in (("fwd", "forward"), ("bwd", "backward"))
      if f"amax_{short}_composite{suffix}" in d.columns
      and (g := _grown(d, f"amax_{short}_composite{suffix}"))
    ]
    if found:
      break
  else:
    return None
  _, ok, lo, hi, ratio, direction = max(found, key=lambda f: f[0])
  top, r = ratio.idxmax(), FINDING_RULES["growth_ratio"]
  rest = [m for m in order if m in ok.index and m != top and ratio[m] * r <= ratio[top]]
  if not rest:
    return None
  text = (
    f"{top}'s {kind} {direction} composite gain grew from {_g(ok.loc[top, lo])} at depth "
    f"{_g(lo)} to {_g(ok.loc[top, hi])} at depth {_g(hi)}"
  )
  vals = {m: ok.loc[m][np.isfinite(ok.loc[m]) & (ok.loc[m] > 0)] for m in rest}
  flat_r = FINDING_RULES["flat_ratio"]
  flat = [m for m in rest if len(vals[m]) and vals[m].max() <= flat_r * vals[m].min()]
  if flat:
    band = _band(min(vals[m].min() for m in flat), max(vals[m].max() for m in flat))
    names = _join([f"{m}'s" for m in flat])
    text += f" while {names} stayed " + (f"within {band}" if "–" in band else f"at {band}")
  else:
    m = min(rest, key=lambda x: ratio[x])
    text += f" while {m}'s went only from {_g(ok.loc[m, lo])} to {_g(ok.loc[m, hi])}"
  sizes = d[d["mixer"].isin([top, *rest])].groupby(["mixer", "_depth"]).size()
  if sizes.max() > 1:
    n = f"{sizes.min()}-{sizes.max()}" if sizes.min() != sizes.max() else str(sizes.max())
    text += f" (geometric means over {n} seeds per mixer and depth)"
  return text


def _spikes(d, order, ctx) -> str | None:
  if "spike_count" not in d.columns:
    return None
  tot = {m: (int(np.nansum(_num(g["spike_count"]))), len(g)) for m, g in d.groupby("mixer")}
  most, none = max(order, key=lambda m: tot[m][0]), [m for m in order if tot[m][0] == 0]
  if tot[most][0] < 2 or not none:
    return None
  (n, k), runs = tot[most], "run" if tot[most][1] == 1 else "runs"
  return f"{most} had {n} loss/gradient spikes in its {k} {runs} while {_join(none)} had none"


def _loss(df, d, ctx) -> str | None:
  """The loss rule: ``df`` the summary table, ``d`` its runs with metrics, labelled by arm."""
  col, what = _endpoint(d)
  unit = "seed" if "seed" in d.columns else "run"
  seeded = "seed" in d.columns and d["seed"].nunique() > 1
  pairs = {}  # (context keys, {mixer_a, mixer_b}) -> the first paired row of ``col``
  for _, p in tables.paired_table(df).iterrows() if seeded else []:
    if p["metric"] == col:
      pairs.setdefault((*map(stats._key, p[ctx]), frozenset(p[["mixer_a", "mixer_b"]])), p)

  def row_for(key, a, b):
    p = pairs.get((*map(stats._key, key), frozenset((a, b))))
    return p if p is not None and p["n_pairs"] > 1 else None

  for key, g in _groups(d, ctx):
    vals = {m: _num(gm[col]) for m, gm in g.groupby("mixer")}
    mean = pd.Series({m: float(np.mean(v)) for m, v in vals.items()})
    mean = mean[np.isfinite(mean)]
    if len(mean) < 2:
      continue
    lo_m, hi_m = mean.idxmin(), mean.idxmax()
    if (mean[hi_m] - mean[lo_m]) < FINDING_RULES["loss_rel_gap"] * abs(mean[lo_m]):
      continue
    na, nb = len(vals[lo_m]), len(vals[hi_m])
    over = f"means over {na} {unit}s each" if na == nb else f"means over {na} and {nb} {unit}s"
    over = "one run each" if max(na, nb) == 1 else over
    means = f"{_g(mean[lo_m])} vs {_g(mean[hi_m])} nats per token"
    row = row_for(key, lo_m, hi_m)
    if row is None and not (seeded and max(na, nb) > 1):
      return f"{_head(ctx, key)}{lo_m} reached a lower {what} than {hi_m} ({means}, {over})"
    if row is None or not row["significant"]:
      continue  # seeds, but no pairs or no difference beyond seed noise
    sign = 1 if row["mixer_b"] == hi_m else -1
    lo, hi = sorted((sign * float(row["diff_ci_lo"]), sign * float(row["diff_ci_hi"])))
    text = (
      f"{_head(ctx, key)}{lo_m} reached a lower {what} than {hi_m}: {means} ({over}); paired "
      f"difference {hi_m} - {lo_m} {sign * float(row['diff_mean']):+.3g} nats, 95% CI "
      f"[{_g(lo)}, {_g(hi)}], n = {int(row['n_pairs'])} seed pairs"
    )
    rows = [x for x in (row_for(k, lo_m, hi_m) for k, _ in _groups(d, ctx)) if x is not None]
    if len(rows) > 1:
      same = sum(
        bool(x["significant"]) and (1 if x["mixer_b"] == hi_m else -1) * x["diff_mean"] > 0
        for x in rows
      )
      where = f"{ctx[0]}s" if len(ctx) == 1 else "groups"
      text += f"; the paired interval excludes 0 at {same} of {len(rows)} {where}"
    return text
  return None


def _no_difference(d) -> str:
  col, what = _endpoint(d)
  parts = [
    f"{name} {_band(v.min(), v.max())}{unit}"
    for c, name, unit in ((col, f"{what}es", " nats"), ("kl_bits", "KL", " bits"))
    if (v := _finite(d, c)).size
  ]
  for c, kind in (
    ("amax_fwd_composite_tok_mean_max", "per-token"),
    ("amax_fwd_composite_max", "token-averaged"),
  ):
    if (v := _finite(d, c)).size:
      parts.append(f"{kind} composite gains {_band(v.min(), v.max())}")
      break
  if "spike_count" in d.columns:
    n = int(np.nansum(_num(d["spike_count"])))
    parts.append("no spikes" if n == 0 else f"{n} spikes in all")
  said = ", ".join(parts) if parts else "no comparable numbers"
  n = len(d)
  return f"The mixers did not differ clearly over {n} run{'s' if n != 1 else ''}: {said}"
