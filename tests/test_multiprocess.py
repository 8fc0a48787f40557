"""Two local processes under jax.distributed (CPU, gloo), started by
launch/local_multiprocess.sh, train the same run as one process with the same global devices
(also across a SIGTERM and --resume), agree on one run directory, and only process 0 writes
the logs."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from mhc_jax import logs
from mhc_jax.train.config import load_config
from mhc_jax.train.loop import prepare, train

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch" / "local_multiprocess.sh"
DEBUG = str(ROOT / "configs" / "debug.yaml")
# 4 global devices as mesh (data, fsdp, tensor) = (1, 2, 2): parameters sharded over fsdp
# across the two processes, heads / MLP over tensor within each. Per-layer diagnostics at every
# step (one compiled step), an evaluation at the end; no periodic checkpoints (SIGTERM makes
# the one).
STEPS = 80  # tiny steps: enough that the run is still going when SIGTERM takes effect
OVERRIDES = [
  "mesh.data=1",
  "mesh.fsdp=2",
  "mesh.tensor=2",
  f"train.steps={STEPS}",
  "train.log_every=1",
  "train.diag_every=1",
  f"train.eval_every={STEPS}",
  "train.ckpt_every=0",
]
KEYS = ("loss", "grad_norm", "param_norm", "gain_fwd", "grad_rms", "eval/loss", "eval/kl_bits")


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def flat(recs, key):
  return np.array([np.ravel(r[key]) for r in recs if key in r], np.float64)


def launch(tmp_path, *args) -> subprocess.Popen:
  env = dict(os.environ)
  # XLA_FLAGS kept: the script replaces only its device count
  env.update(
    JAX_PLATFORMS="cpu",
    MHC_DEVICES_PER_PROCESS="2",
    MHC_PORT=str(free_port()),
    MHC_JAX=f"{sys.executable} -m mhc_jax.cli",
    JAX_DISABLE_MOST_OPTIMIZATIONS="1",
    JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),  # the resume: no compiles
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
  )
  return subprocess.Popen(
    ["bash", str(LAUNCH), "2", "train", "--quiet", *args],
    cwd=tmp_path,
    env=env,
    text=True,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
  )


def last_step(runs_dir: Path) -> int:
  try:
    (metrics,) = runs_dir.glob("*/metrics.jsonl")
    recs = logs.read_jsonl(metrics)
  except ValueError:  # not there yet (or a line being written)
    return -1
  return recs[-1]["step"] if recs else -1


@pytest.mark.slow
def test_two_processes_train_like_one_and_resume_after_sigterm(tmp_path):
  runs_dir = tmp_path / "runs" / "debug"
  term_at = random.Random().randrange(5, 25)
  # no --out: the processes must agree on the default (time-stamped) run directory
  proc = launch(tmp_path, "--config", DEBUG, "--set", *OVERRIDES)
  try:
    deadline = time.monotonic() + 300
    while last_step(runs_dir) < term_at:
      assert proc.poll() is None, f"ended before step {term_at}: {proc.communicate()[1][-3000:]}"
      assert time.monotonic() < deadline, f"no step {term_at} within the deadline"
      time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)  # the script passes it on to both processes
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, f"SIGTERM at step {term_at}: {err[-3000:]}"

    runs = list(runs_dir.iterdir())
    assert len(runs) == 1, runs  # one run directory for both processes
    run = runs[0]
    printed = {
      line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("run directory: ")
    }
    assert printed == {str(run.relative_to(tmp_path))}, out
    assert err.count("SIGTERM at step") == 2, err[-3000:]  # both stopped, at the same step
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "preempted" and term_at < summary["steps"] < STEPS, summary
    assert (run / "checkpoints" / str(summary["steps"])).is_dir()

    proc = launch(tmp_path, "--out", str(run), "--resume")
    # meanwhile, the reference: one process, the same 4 devices as one (1, 2, 2) mesh
    train(
      prepare(load_config(DEBUG, OVERRIDES), devices=jax.devices()[:4]),
      tmp_path / "one",
      progress=False,
    )
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.communicate()
  assert out.count(f"done: {STEPS} steps") == 1, out  # only process 0 reports

  got = logs.read_jsonl(run / "metrics.jsonl")
  want = logs.read_jsonl(tmp_path / "one" / "metrics.jsonl")
  assert [r["step"] for r in got] == list(range(STEPS))  # each step once: only process 0 writes
  assert [r["step"] for r in want] == list(range(STEPS))
  for key in KEYS:
    assert flat(want, key).size and flat(got, key).shape == flat(want, key).shape, key
    np.testing.assert_allclose(
      flat(got, key),
      flat(want, key),
      rtol=1e-5,
      atol=1e-7,
      err_msg=f"{key} (SIGTERM at step {term_at})",
    )
  assert json.loads((run / "summary.json").read_text())["status"] == "done"
  assert sorted(p.name for p in run.iterdir()) == [
    "checkpoints",
    "config.yaml",
    "events.jsonl",
    "metrics.jsonl",
    "summary.json",
  ]


SCRIPTS = ["local_multiprocess.sh", "tpu_pod.sh", "slurm_gpu.sbatch"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_launch_scripts_parse_and_lint(name):
  """The cloud scripts cannot run here: they must at least parse (and pass shellcheck)."""
  path = ROOT / "launch" / name
  assert os.access(path, os.X_OK), f"{name} is not executable"
  subprocess.run(["bash", "-n", str(path)], check=True)
  if shutil.which("shellcheck"):
    p = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout


def test_local_multiprocess_usage():
  p = subprocess.run(["bash", str(LAUNCH), "two", "train"], capture_output=True, text=True)
  assert p.returncode == 2 and "usage:" in p.stderr
