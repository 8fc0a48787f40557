"""The papers' three geometry figures and a CSV of the scores, side by side for several runs.

  python benchmarks/geometry_figures.py --runs residual=RUN_DIR hc=RUN_DIR ... --out DIR

Each RUN_DIR is a trained run (any mixer, bijection or HMM). A run whose eval.json lacks the
papers' probes (``probes.paper``) is evaluated first (``mhc-jax eval``, 8 batches; rewrites its
eval.json). Writes DIR/geometry.png (columns: runs; rows: key orthogonality matrix, q-k alignment
vs evidence, value PCA coloured by entropy) and DIR/geometry_scores.csv (one row per run,
``mhc_jax.geometry.plots.CSV_FIELDS``). Bad input: one ``error:`` line, exit 2, nothing written.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path


def parse_runs(items: list[str]) -> dict[str, Path]:
  runs: dict[str, Path] = {}
  for it in items:
    name, sep, d = it.partition("=")
    if not sep or not name or not d:
      raise ValueError(f"--runs takes NAME=RUN_DIR, got {it!r}")
    if name in runs:
      raise ValueError(f"--runs: the name {name!r} is given twice")
    p = Path(d)
    if not (p / "config.yaml").is_file():
      raise ValueError(f"--runs {name}: {p} is not a run directory (no config.yaml)")
    runs[name] = p
  return runs


def load_eval(run: Path) -> dict:
  from mhc_jax import evaluate, storage

  f = run / "eval.json"
  if f.is_file():
    ev = json.loads(f.read_text())
    if ev.get("probes", {}).get("paper"):
      return ev
  ev = evaluate.evaluate_run(run)
  storage.write_json_atomic(f, ev)
  return json.loads(f.read_text())


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--runs", nargs="+", required=True, metavar="NAME=RUN_DIR")
  ap.add_argument("--out", required=True)
  a = ap.parse_args(argv)
  from mhc_jax.geometry import plots as G

  try:
    runs = parse_runs(a.runs)
    evals = {name: load_eval(run) for name, run in runs.items()}
    rows = G.score_rows(evals)
  except Exception as e:  # one line, nothing written
    print(f"error: {e}", file=sys.stderr)
    return 2
  out = Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  G.draw(evals, out / "geometry.png")
  with open(out / "geometry_scores.csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=G.CSV_FIELDS)
    w.writeheader()
    w.writerows(rows)
  print(f"wrote {out / 'geometry.png'} and {out / 'geometry_scores.csv'} ({len(rows)} runs)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
