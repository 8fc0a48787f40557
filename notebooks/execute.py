"""Train the small sweep of notebooks/sweep.yaml and execute the three notebooks in place on it,
so the committed notebooks carry their outputs and figures (what a reader sees online).

  python notebooks/execute.py [--out DIR] [--timeout SECONDS]

DIR (default sweeps_out/notebooks) gets the sweep through ``mhc-jax sweep`` (re-running continues
a killed sweep, and a finished one only re-executes the notebooks). Notebook 01 is pointed at the
deepest mHC run of seed 0 (``MHC_RUN_DIR``), 02 and 03 at the sweep (``MHC_SWEEP_DIR``), as
tests/test_notebooks.py does. Needs the notebooks extra (``pip install -e ".[notebooks]"``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import nbclient
import nbformat

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
NOTEBOOKS = ("01_quickstart", "02_stability_sweep", "03_bayesian_geometry")


def deepest_mhc_run(sweep: Path) -> Path:
  """The run directory of the deepest mHC run of the first seed."""
  runs = json.loads((sweep / "manifest.json").read_text())["runs"]
  mhc = [i for i in runs.values() if i["overrides"].get("model.mixer") == "mhc"]
  first = min(i["overrides"].get("train.seed", 0) for i in mhc)
  mhc = [i for i in mhc if i["overrides"].get("train.seed", 0) == first]
  return sweep / max(mhc, key=lambda i: i["overrides"].get("model.depth", 0))["dir"]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=str(ROOT / "sweeps_out" / "notebooks"), help="sweep directory")
  ap.add_argument("--timeout", type=int, default=600, help="seconds per notebook cell")
  args = ap.parse_args(argv)
  out = Path(args.out).resolve()
  t0 = time.perf_counter()
  cmd = [sys.executable, "-m", "mhc_jax.cli", "sweep", str(HERE / "sweep.yaml"), "--out", str(out)]
  code = subprocess.run([*cmd, "--quiet"], cwd=ROOT).returncode
  if code:
    print(f"sweep failed (exit {code}); notebooks not executed", file=sys.stderr)
    return code
  print(f"sweep: {time.perf_counter() - t0:.0f}s")
  # relative to the notebooks (the kernels' working directory): the committed outputs then
  # print nothing of the machine that executed them
  rel = lambda p: os.path.relpath(p, HERE)
  os.environ.update(MHC_SWEEP_DIR=rel(out), MHC_RUN_DIR=rel(deepest_mhc_run(out)))
  for name in NOTEBOOKS:
    path = HERE / f"{name}.ipynb"
    nb = nbformat.read(path, as_version=4)
    t = time.perf_counter()
    nbclient.NotebookClient(
      nb, kernel_name="python3", timeout=args.timeout, resources={"metadata": {"path": str(HERE)}}
    ).execute()
    nbformat.write(nb, path)
    print(f"{path.relative_to(ROOT)}: executed in {time.perf_counter() - t:.0f}s")
  print(f"total: {time.perf_counter() - t0:.0f}s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
