"""benchmarks/geometry_gpu.sh, the formation study sized for one lent accelerator call: its
sizing arithmetic (benchmarks/geometry_gpu.py), its refusal of the CPU, and its own commands at
toy size on the CPU, so that the script cannot rot between the calls on a GPU."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]


sys.path.insert(0, str(ROOT / "benchmarks"))

import geometry_gpu as gg  # noqa: E402


def _arms(step_s=0.04, row_s=1.5, reached=150):
  """Three arms measured as the script measures them: trained to ``reached``, 5 rows read."""
  return {
    a: gg.ArmCost(step_s=step_s, reached=reached, eval_run_s=2.0, eval_row_s=row_s, rows_done=5)
    for a in gg.ARMS
  }


def test_series_steps_are_the_studys():
  """The steps a run is read at: 0, the study's series up to its last step, and that step."""
  spec = importlib.util.spec_from_file_location("formation_analysis", gg.ANALYSIS)
  an = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(an)
  assert gg.SERIES == an.STEPS
  assert gg.series_steps(1000) == [0, 100, 200, 300, 400, 500, 750, 1000]
  assert gg.series_steps(1200)[-2:] == [1000, 1200]
  assert gg.series_steps(2500) == [0, *gg.SERIES]


def test_cost_by_hand():
  """One arm from step 0 to 100: resume + 100 steps; 3 runs opened, 3 x 2 rows (0 and 100)."""
  arm = {"a": gg.ArmCost(step_s=0.1, eval_run_s=1.0, eval_row_s=2.0)}
  assert gg.cost(100, arm) == pytest.approx(gg.RESUME_S + 10.0 + 3 * 1.0 + 6 * 2.0)
  done = {"a": gg.ArmCost(step_s=0.1, reached=100, eval_run_s=1.0, eval_row_s=2.0, rows_done=6)}
  assert gg.cost(100, done) == pytest.approx(3 * 1.0)  # trained, read: only opening the runs


def test_choose_steps_fits_the_budget():
  """The most steps whose cost fits: a multiple of 50, at most 2500; a slower step or a costlier
  series gives fewer; a budget that holds not even step 100 is refused."""
  n = gg.choose_steps(_arms(), 300.0)
  assert n % 50 == 0 and 100 <= n < 2500
  assert gg.cost(n, _arms()) <= 300.0 < gg.cost(n + 50, _arms())
  assert gg.choose_steps(_arms(step_s=0.08), 300.0) < n
  assert gg.choose_steps(_arms(row_s=3.0), 300.0) < n
  assert gg.choose_steps(_arms(), 600.0) > n
  assert gg.choose_steps(_arms(), 1e6) == 2500
  assert gg.choose_steps(_arms(), 1e6, every=5, cap=30, series=(10, 20, 30)) == 30
  with pytest.raises(ValueError, match="cannot fit the first checkpoint of the series"):
    gg.choose_steps(_arms(reached=0), 30.0)


def _wait(cond, timeout=10.0) -> bool:
  import time

  end = time.monotonic() + timeout
  while not cond() and time.monotonic() < end:
    time.sleep(0.02)
  return cond()


def test_stopper_signals_at_the_step_and_at_the_deadline(tmp_path):
  """The stop: SIGTERM to this process once every run holds a checkpoint at the step (the
  trainer's own stop), or at the deadline; the time each step was first held by all runs."""
  import signal
  import time

  got = []
  old = signal.signal(signal.SIGTERM, lambda *_: got.append(time.monotonic()))
  try:
    dirs = [tmp_path / f"seed={s}" for s in range(2)]
    st = gg.Stopper(dirs, 10, math.inf)
    st.start()
    for step in (5, 10):
      (dirs[0] / "checkpoints" / str(step)).mkdir(parents=True)
      time.sleep(0.15)
      assert step not in st.seen and not got  # one run holds it, the other not yet
      (dirs[1] / "checkpoints" / str(step)).mkdir(parents=True)
      assert _wait(lambda: step in st.seen)
    assert _wait(lambda: got)
    st.finish()
    assert st.fired == "step" and st.seen[5] < st.seen[10] <= got[0]
    n = len(got)
    st = gg.Stopper([tmp_path / "none"], None, time.monotonic() + 0.1)
    st.start()
    assert _wait(lambda: len(got) > n)
    st.finish()
    assert st.fired == "deadline" and not st.seen
  finally:
    signal.signal(signal.SIGTERM, old)


def _script(tmp_path, *args):
  env = dict(os.environ, PY=sys.executable, TMPDIR=str(tmp_path))
  env.pop("OUT", None)
  return subprocess.run(
    ["bash", str(ROOT / "benchmarks" / "geometry_gpu.sh"), *args],
    capture_output=True,
    text=True,
    env=env,
    timeout=900,
  )


def test_refuses_the_cpu_without_toy(tmp_path):
  r = _script(tmp_path, "--out", str(tmp_path / "out"))
  assert r.returncode == 2 and "error: no accelerator visible to jax" in r.stderr, r.stderr
  assert not (tmp_path / "out").exists()
  r = _script(tmp_path, "--out", str(tmp_path / "out"), "--toy", "--steps", "7")
  assert r.returncode == 2 and "error: --steps 7" in r.stderr, r.stderr
  r = _script(tmp_path, "--bogus")
  assert r.returncode == 2 and "usage:" in r.stderr


@pytest.mark.slow
def test_runs_at_toy_size(tmp_path):
  """The script's commands at toy size (measure, size, train on, the series, the analysis):
  every arm and seed has its rows, the JSON its measured step time and the steps reached, and
  the scratch folder (the sweeps and their checkpoints) is gone."""
  out = tmp_path / "out"
  r = _script(tmp_path, "--toy", "--out", str(out), "--steps", "20", "--budget-s", "900")
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  rep = json.loads((out / "geometry_gpu.json").read_text())
  assert rep["phase"] == "done" and rep["steps"] == 20 and rep["steps_from"] == "--steps"
  sized = rep["sizing"]["steps"]
  assert sized % 5 == 0 and 10 <= sized <= 30
  assert set(rep["arms"]) == {"residual", "hc", "mhc"}
  for arm in rep["arms"].values():
    assert arm["step_s"] > 0 and arm["eval_row_s"] > 0 and arm["steps_reached"] >= 20
    assert arm["stopped_by"] == arm["train_stopped_by"] == "step"  # SIGTERM, at the step
  runs = pd.read_csv(out / "runs.csv")
  got = runs.groupby(["arm", "seed"])["step"].apply(sorted).to_dict()
  assert got == {(a, s): [0, 10, 20] for a in ("residual", "hc", "mhc") for s in range(3)}
  assert runs["frame_ratio"].notna().all() and runs["mae"].notna().all()
  for a in ("residual", "hc", "mhc"):
    for s in range(3):
      d = out / "runs" / a / f"seed={s}"
      assert (d / "metrics.jsonl").exists() and (d / "config.yaml").exists()
      assert len(pd.read_csv(d / "geometry_series.csv")) == 3
    assert (out / "sweeps" / f"{a}.yaml").exists()
  assert list(pd.read_csv(out / "decision.csv")["arm"]) == ["residual", "hc", "mhc"]
  assert not list(tmp_path.glob("geometry_gpu.*"))  # the scratch folder, removed
