"""Sweep progress (mhc_jax.sweep.progress): counts and the ETA, on hand-written manifests."""

import json

import pytest

from mhc_jax.sweep.progress import SweepProgress, format_eta, last_step


def _log(run_dir, steps):
  run_dir.mkdir(parents=True)
  (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in steps))


def test_format_eta():
  assert format_eta(None) == format_eta(float("nan")) == format_eta(-1) == "?"
  assert (format_eta(42), format_eta(61), format_eta(3725)) == ("42s", "1m01s", "1h02m")


def test_last_step_reads_the_tail(tmp_path):
  _log(tmp_path / "r", range(5))
  with open(tmp_path / "r" / "metrics.jsonl", "a") as f:
    f.write('{"step": 9, "trunc')  # a half-written last line
  assert last_step(tmp_path / "r" / "metrics.jsonl") == 4
  assert last_step(tmp_path / "nope.jsonl") is None


def test_eta_from_finished_runs(tmp_path):
  steps = {f"r{i}": 100 for i in range(4)}
  _log(tmp_path / "runs" / "r2", range(50))
  runs = {
    "r0": {"status": "done", "wall_s": 10.0, "dir": "runs/r0"},
    "r1": {"status": "done", "wall_s": 30.0, "dir": "runs/r1"},
    "r2": {"status": "running", "dir": "runs/r2"},
    "r3": {"status": "pending", "dir": "runs/r3"},
  }
  p = SweepProgress("s", tmp_path, steps, parallel=2, enabled=False)
  # (0.5 + 1) runs left x median 20 s, 2 at once
  assert p.estimate(runs) == pytest.approx(1.5 * 20.0 / 2)


def test_eta_counts_a_population_as_runs_at_once(tmp_path):
  # one process (parallel 1) trains 8 population members together: all 8 run at once, so the
  # ETA is one member's remaining time, not 8 members one after another
  steps = {f"m{i}": 100 for i in range(8)}
  runs = {"done": {"status": "done", "wall_s": 40.0}}
  steps["done"] = 100
  for i in range(8):
    _log(tmp_path / "runs" / f"m{i}", range(75))
    runs[f"m{i}"] = {"status": "running", "dir": f"runs/m{i}"}
  p = SweepProgress("s", tmp_path, steps, parallel=1, enabled=False)
  assert p.estimate(runs) == pytest.approx(8 * 0.25 * 40.0 / 8)
  assert p.estimate({"done": runs["done"]}) == 0.0
