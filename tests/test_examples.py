"""examples/my_mixer, as a user outside the repository has it: the package copied out of the tree
and put on PYTHONPATH, its own test file run with pytest, and its mixer through the public
commands only (``mhc-jax train``, ``mhc-jax sweep --parallel`` with the example's sweep file,
``mhc-jax report``) at toy size."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "my_mixer"
MIXER = "my_mixer.rezero:ReZero"
TOY = [  # configs/debug.yaml's sizes, for a sweep file that has no base
  *("model.depth=1", "model.width=16", "model.heads=2", "data.seq_len=16", "data.batch_size=8"),
  *("data.options.n_symbols=4", "data.eval_batches=1", "optim.warmup_steps=1", "train.steps=30"),
  *("optim.lr=1e-2", "train.diag_every=10", "train.eval_every=30"),
]


@pytest.fixture(scope="module")
def user(tmp_path_factory):
  """(the example's copy outside the repository, an environment that finds it)."""
  home = tmp_path_factory.mktemp("user")
  pkg = home / "my_mixer"
  shutil.copytree(EXAMPLE, pkg, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
  path = [str(pkg), *os.environ.get("PYTHONPATH", str(REPO)).split(os.pathsep)]
  return home, {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def _run(env, cwd, *args):
  """``mhc-jax ARGS`` (the installed command), or ``python -m pytest ARGS``; its stdout."""
  cli = [str(Path(sys.executable).with_name("mhc-jax"))]
  cmd = [sys.executable, "-m", *args] if args[0] == "pytest" else [*cli, *args]
  p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  return p.stdout


def test_the_examples_own_tests_pass(user):
  home, env = user
  out = _run(env, home, "pytest", "-q", "-p", "no:cacheprovider", str(home / "my_mixer" / "tests"))
  assert "2 passed" in out


@pytest.mark.slow
def test_train_sweep_and_report_through_the_public_commands(user):
  home, env = user
  run = home / "run"
  _run(env, home, "train", "--config", str(REPO / "configs" / "debug.yaml"), "--out", str(run),
       "--quiet", "--set", f"model.mixer={MIXER}", *TOY)  # fmt: skip
  loss = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]
  assert all(map(math.isfinite, loss)) and loss[-1] < 0.9 * loss[0]
  source = json.loads((run / "mixer_source.json").read_text())
  assert source == {
    "mixer": MIXER,
    "file": str(home / "my_mixer" / "my_mixer" / "rezero.py"),
    "version": "0.1.0",
  }
  sweep = home / "sweep_out"
  _run(env, home, "sweep", str(home / "my_mixer" / "sweep.yaml"), "--out", str(sweep), "--quiet",
       "--parallel", "2", "--set", *TOY)  # fmt: skip
  assert (sweep / "submitit").is_dir()  # the runs trained in the jobs' processes
  _run(env, home, "report", str(sweep))
  table = pd.read_csv(sweep / "report" / "summary.csv").set_index("mixer")
  assert list(table.index) == ["residual", MIXER] and set(table["status"]) == {"done"}
  rezero = table.loc[MIXER]
  assert math.isfinite(rezero["final_loss"]) and rezero["final_loss"] < 0.9 * rezero["loss_init"]
  assert MIXER in (sweep / "report" / "summary.md").read_text()
