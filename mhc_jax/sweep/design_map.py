"""``mhc-jax map MIXER``: one design's row of the zoo's stability map, trained on the zoo map's grid
and regime through the sweep runner, then printed and drawn among the zoo map's committed rows
(``reference/zoo_map_lr_sensitivity.csv``, package data). The command: docs/sweeps.md, "One
design on the map"; the rules: docs/sweeps.md, "Stability maps"."""

from __future__ import annotations

import argparse
import math
from importlib import resources

import pandas as pd

from mhc_jax import storage
from mhc_jax.errors import EXIT_OK, EXIT_PREEMPTED, UsageError

DEPTHS, SEEDS = "4,8,16", "3"
LRS = "1e-3,3e-3,1e-2,3e-2,0.1,0.3,1"
REFERENCE = "residual,mhc,hc"
#: configs/text.yaml with configs/studies/zoo_map.yaml's ``set`` and its cpu variant (the test
#: checks every run's config equals the zoo map's for the same mixer, depth, lr and seed).
REGIME = """data.task=text data.options.val_fraction=0.05 data.seq_len=64 data.batch_size=8
data.eval_batches=8 model.width=32 model.heads=4 optim.clip=0 optim.warmup_steps=15 train.steps=150
train.log_every=1 train.diag_every=10 train.eval_every=150 train.ckpt_every=0""".split()
#: The zoo map's rows by family (docs/studies/zoo_map/analysis.py reads them from here).
FAMILIES = {
  "pre-LN, one stream": ["residual", "residual_qk", "value_residual", "laurel", "ortho"],
  "norm placement": ["post_ln", "deepnorm", "peri_ln"],
  "sums over depth": ["denseformer", "attnres"],
  "streams, unconstrained": ["hc", "hc_qk", "frac"],
  "streams, doubly stochastic": ["mhc", "mhc_uniform", "mhc_lite", "kromhc"],
  "streams, fixed": ["mhc_identity"],
}
#: Measured: the zoo map's 1,134 runs (92 TFLOPs) took 22,916 population-seconds on 2 shared CPU
#: cores (docs/studies/zoo_map/README.md), 4.0 GFLOP/s; designs ran 0.5-5x that rate.
FLOPS_PER_S = 92e12 / 22_916


def references() -> pd.DataFrame:
  """The zoo map's lr_sensitivity.csv (docs/studies/zoo_map/), as shipped with the package."""
  ref = resources.files("mhc_jax.sweep") / "reference" / "zoo_map_lr_sensitivity.csv"
  with ref.open() as f:
    return pd.read_csv(f)


def _list(flag: str, text: str, kind) -> list:
  try:
    vals = [kind(v) for v in text.split(",")]
  except ValueError:
    vals = []
  if not vals or min(vals) <= 0 or len(set(vals)) < len(vals):
    raise UsageError(f"{flag}: expected distinct comma-separated positive numbers, got {text!r}")
  return sorted(vals)


def plan(args) -> argparse.Namespace:
  """sweep, label, arms (the reference rows), comparable (the zoo's grid and regime) from the
  command's flags; UsageError or ConfigError before anything is written."""
  from mhc_jax import mixers
  from mhc_jax.sweep import grid

  try:
    mixers.resolve(args.mixer)
  except ValueError as e:
    raise UsageError(f"map: {e}") from None
  known = list(dict.fromkeys(references()["arm"]))
  ref = args.reference or REFERENCE
  arms = known if ref == "all" else ref.split(",")
  if bad := [a for a in arms if a not in known]:
    raise UsageError(f"--reference: {', '.join(bad)} not in the zoo map (rows: {', '.join(known)})")
  label = args.mixer.rpartition(":")[2].rpartition(".")[2].lower()
  label = f"{label}_new" if label in known else label
  depths = _list("--depths", args.depths or DEPTHS, int)
  lrs, seeds = _list("--lrs", args.lrs or LRS, float), _list("--seeds", args.seeds or SEEDS, int)
  if len(seeds) > 1:
    raise UsageError(f"--seeds: expected a number of seeds, got {args.seeds!r}")
  par = [f"model.parametrization={args.parametrization}"] if args.parametrization else []
  data = {
    "name": f"map_{label}",
    "set": [*REGIME, f"model.mixer={args.mixer}", *par],
    "axes": {"arm": {label: {"model.mixer": args.mixer}}, "model.depth": depths, "optim.lr": lrs},
    "population": ["optim.lr"],
    "seeds": seeds[0],
  }
  sweep = grid.read_sweep(None, args.set, data=data)
  zoo = [_list("", DEPTHS, int), _list("", LRS, float), int(SEEDS), "sp"]
  same = [depths, lrs, seeds[0], sweep.base_config["model"]["parametrization"]] == zoo
  same &= all(s.startswith("model.mixer_options.") for s in args.set)
  return argparse.Namespace(sweep=sweep, label=label, arms=arms, comparable=same)


def check_contract(sweep) -> None:
  """mhc_jax.testing.check_mixer on the sweep's mixer and options; UsageError listing failures."""
  from mhc_jax import testing

  model = sweep.base_config["model"]
  try:
    with testing.xla_optimizations(False):  # tiny programs: compiling is most of their time
      testing.check_mixer(model["mixer"], **model["mixer_options"])
  except AssertionError as e:
    head, *fails = str(e).splitlines()
    how = [f"{f[2:].split(':')[0]} ({f.partition(' Failed: ')[2]})" for f in fails]
    raise UsageError(f"map: {head}, nothing trained: {'; '.join(how)}") from None


def _g(v: float, fmt: str = "g") -> str:
  return "none" if not math.isfinite(v) else format(v, fmt)


def _edge(r) -> str:
  """The largest working lr as the zoo's README writes it (>= x: nothing failed up the grid,
  lrmap.lr_table's ``edge_censored``)."""
  return (">= " if r.edge_censored else "") + _g(r.largest_working_lr)


def table(tab: pd.DataFrame) -> pd.DataFrame:
  """A row per arm of ``tab`` (lrmap.lr_table's rows), its depths' values joined by " / "."""
  cells = {
    "best lr": lambda r: _g(r.best_lr),
    "largest working lr": _edge,
    "first failure": lambda r: (
      f"{_g(r.first_failing_lr)} ({r.first_failure})" if isinstance(r.first_failure, str) else "-"
    ),
    "LR sensitivity": lambda r: _g(r.lr_sensitivity, ".2f"),
  }
  rows = []
  for arm, g in tab.groupby("arm", sort=False):
    rs = list(g.sort_values("depth").itertuples())
    rows.append({"design": arm, "depths": " / ".join(str(r.depth) for r in rs)})
    rows[-1].update({k: " / ".join(f(r) for r in rs) for k, f in cells.items()})
  return pd.DataFrame(rows)


def _fall(g: pd.DataFrame) -> float:
  """Half-decade grid steps the edge falls from the shallowest depth to the deepest; inf where it
  ends with no working lr ("none": the best lr's own runs failed), -inf where it starts so,
  NaN where both ends have none."""
  e0, e1 = g.sort_values("depth")["largest_working_lr"].to_numpy(float)[[0, -1]]
  if math.isnan(e0) or math.isnan(e1):
    return math.nan if math.isnan(e0) and math.isnan(e1) else math.copysign(math.inf, e0 - e1)
  return round(2 * math.log10(e0 / e1))


def _moves(k: float, s: str = "s") -> str:
  if math.isnan(k):
    return f"ha{'s' if s else 've'} none at either end"
  if math.isinf(k):
    return f"end{s} with no working lr" if k > 0 else f"start{s} with none"
  return (
    f"hold{s}" if k == 0 else f"{'fall' if k > 0 else 'rise'}{s} {abs(k)} step{'s' * (abs(k) > 1)}"
  )


def _and(names: list[str]) -> str:
  return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def sentence(tab: pd.DataFrame, label: str, comparable: bool) -> str:
  """What the rows say about ``label``'s edge against the other arms of ``tab`` (its fall with
  depth in grid steps of half a decade), and what they do not decide."""
  mine, refs = tab[tab["arm"] == label].sort_values("depth"), tab[tab["arm"] != label]
  d, open_ = mine["depth"].tolist(), ["what lies between two grid points"]
  edges = " / ".join(_edge(r) for r in mine.itertuples())
  text = f"{label}'s largest working lr is {edges} at depths {' / '.join(map(str, d))}"
  if len(d) > 1:
    k, falls = _fall(mine), {a: _fall(g) for a, g in refs.groupby("arm", sort=False)}
    text += f": from depth {d[0]} to {d[-1]} its edge {_moves(k)}"
    for v in sorted(set(falls.values())):
      arms = [f"{a}'s" for a, f in falls.items() if f == v]
      text += f", {_and(arms)} {_moves(v, 's' if len(arms) == 1 else '')}"
    text += " (a step: half a decade)"
    far = [f"{'less' if v > k else 'more'} than {a}'s" for a, v in falls.items() if abs(v - k) > 1]
    text += f"; it falls {_and(far)} by two steps or more" if far else ""
    if near := [a for a, v in falls.items() if abs(v - k) == 1]:
      open_[0] = f"a one-step difference (from {_and(near)}), which one seed of three near the "
      open_[0] += "no-training floor can make"
  deep = mine["lr_sensitivity"].iloc[-1]
  text += f". Its LR sensitivity at depth {d[-1]} is {deep:.2f} nats"
  at = refs[refs["depth"] == d[-1]]["lr_sensitivity"]
  text += f" (references {at.min():.2f}-{at.max():.2f})." if len(at) else "."
  if top := [str(r.depth) for r in mine.itertuples() if _edge(r).startswith(">=")]:
    open_.append(f"its edge at depth {_and(top)}, above the grid's top")
  if not comparable:
    open_.append("any comparison: this grid or regime is not the zoo map's")
  return text + f" Not decided: {'; '.join(open_)}."


def estimate(sweep, setups) -> str:
  from mhc_jax.sweep import grid

  flops = float(grid.dry_run_table(sweep, setups)["train_flops"].sum())
  return (
    f"estimate: about {flops / FLOPS_PER_S / 60:.0f} min, one population at a time, at the zoo "
    f"map's measured {FLOPS_PER_S / 1e9:.1f} GFLOP/s on 2 shared CPU cores (designs ran "
    f"0.5-5x that; --parallel K divides it by up to K on K free cores)"
  )


def main(args) -> int:
  """``mhc-jax map`` (args: mixer, set, parametrization, depths, lrs, seeds, out, parallel,
  executor, reference, dry_run, quiet)."""
  from mhc_jax.sweep import grid, lrmap, plots, report, runner, study

  p = plan(args)
  check_contract(p.sweep)
  out = storage.path(args.out or f"sweeps_out/{p.sweep.name}")
  if args.dry_run:
    setups = grid.prepare_runs(p.sweep)
    runner.print_dry_run(p.sweep, setups, out)
    print(estimate(p.sweep, setups))
    return EXIT_OK
  ns = argparse.Namespace(**vars(args), sweep_file=None, variant=None)
  ns.coordinator = ns.num_processes = ns.process_id = None
  code = runner.main(ns, p.sweep)
  if code == EXIT_PREEMPTED:
    return code
  runs = study.read_runs(out)
  runs.to_csv(out / "runs.csv", index=False)
  ref = references()
  tab = pd.concat([lrmap.lr_table(runs), ref[ref["arm"].isin(p.arms)]], ignore_index=True)
  tab.to_csv(out / "lr_sensitivity.csv", index=False)
  plots.edge_chart(tab, out / "edges.png", families={**FAMILIES, "this design": [p.label]})
  print(report.md_table(table(tab)))
  print(sentence(tab, p.label, p.comparable))
  print(f"map: {out}/runs.csv, lr_sensitivity.csv, edges.png")
  return code
