"""`mhc-jax train`: bad input exits 2 with one message and writes nothing, runs are never
overwritten, a halted run exits 3, SIGKILL / SIGTERM and --resume continue the exact
trajectory, and the quickstart logs every documented metric name.

Most cases call ``mhc_jax.cli.main`` in-process (no jax import per case); real processes only
where the test needs one (kill signals, the exit status of the program itself).
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from mhc_jax import cli, logs
from mhc_jax.train.config import load_config, save_config

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "configs" / "debug.yaml")
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")


def run_cli(capsys, *argv) -> tuple[int, str, str]:
  rc = cli.main(["train", *argv])
  out, err = capsys.readouterr()
  return rc, out, err


def snapshot(path: Path) -> dict:
  return {str(p.relative_to(path)): (p.read_bytes(), p.stat().st_mtime_ns)
          for p in sorted(path.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- bad input

def _bad_yaml(tmp):
  p = tmp / "bad.yaml"
  p.write_text("model:\n  depth: [1, 2\n  width: 16\n")
  return p


def _list_yaml(tmp):
  p = tmp / "list.yaml"
  p.write_text("- model\n- data\n")
  return p


# (id, config file maker or None for debug.yaml, --set overrides or extra flags, key in message)
BAD = [
    ("unknown key", None, ["--set", "model.dept=2"], "model.dept"),
    ("wrong type", None, ["--set", "model.depth=two"], "model.depth"),
    ("heads do not divide width", None, ["--set", "model.heads=3"], "model.heads"),
    ("mesh does not match devices", None, ["--set", "mesh.data=3"], "mesh"),
    ("batch not divisible by mesh", None, ["--set", "data.batch_size=12"], "data.batch_size"),
    ("negative lr", None, ["--set", "optim.lr=-1e-3"], "optim.lr"),
    ("missing data dir", None,
     ["--set", "data.task=text", 'data.options={"path": "/nonexistent/corpus"}'],
     "data.options.path"),
    ("malformed yaml", _bad_yaml, [], "invalid YAML at line"),
    ("yaml not a mapping", _list_yaml, [], "top level must be a mapping"),
    ("missing config file", lambda tmp: tmp / "nope.yaml", [], "nope.yaml: not found"),
    ("unknown mixer", None, ["--set", "model.mixer=mhcc"], "model.mixer"),
    ("bad mixer option value", None,
     ["--set", "model.mixer=mhc", "model.mixer_options.sinkhorn_iters=0"],
     "model.mixer_options.sinkhorn_iters"),
    ("option of another mixer", None,
     ["--set", "model.mixer=hc", "model.mixer_options.sinkhorn_iters=5"],
     "model.mixer_options.sinkhorn_iters"),
    ("unknown data option", None, ["--set", "data.options.n_symbol=4"], "data.options.n_symbol"),
    ("vocab below the data's", None, ["--set", "model.vocab=4"], "model.vocab"),
    ("warmup beyond steps", None, ["--set", "optim.warmup_steps=50"], "optim.warmup_steps"),
    ("override without =", None, ["--set", "model.depth"], "model.depth"),
    ("process id out of range", None, ["--num-processes", "2", "--process-id", "2"],
     "dist.process_id"),
    ("unknown nonfinite policy", None, ["--set", "train.nonfinite=ignore"], "train.nonfinite"),
]


@pytest.mark.parametrize("maker,extra,key", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config_one_message_exit_2_nothing_written(maker, extra, key, tmp_path, capsys,
                                                        monkeypatch):
  monkeypatch.chdir(tmp_path)  # a default run directory would appear under ./runs
  config = str(maker(tmp_path)) if maker else DEBUG
  before = sorted(tmp_path.iterdir())
  out = tmp_path / "run"
  rc, stdout, stderr = run_cli(capsys, "--config", config, "--out", str(out), "--quiet", *extra)
  assert rc == 2, stderr
  lines = stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), stderr
  assert key in lines[0], lines[0]
  assert "Traceback" not in stderr and stdout == ""
  assert not out.exists() and sorted(tmp_path.iterdir()) == before


def test_resume_on_a_directory_that_is_not_a_run(tmp_path, capsys):
  plain = tmp_path / "plain"
  plain.mkdir()
  (plain / "notes.txt").write_text("mine")
  for target in (plain, tmp_path / "missing"):
    for flags in (["--config", DEBUG], []):  # with a config, or from the run's own config.yaml
      rc, _, err = run_cli(capsys, "--out", str(target), "--resume", "--quiet", *flags)
      assert rc == 2 and err.count("error: ") == 1 and str(target) in err, err
  assert not (tmp_path / "missing").exists()
  assert [p.name for p in plain.iterdir()] == ["notes.txt"]
  rc, _, err = run_cli(capsys, "--resume", "--config", DEBUG)
  assert rc == 2 and "--resume needs --out" in err


def test_out_is_a_file(tmp_path, capsys):
  f = tmp_path / "results.txt"
  f.write_text("keep")
  rc, _, err = run_cli(capsys, "--config", DEBUG, "--out", str(f), "--quiet")
  assert rc == 2 and "--out" in err and "not a directory" in err, err
  assert f.read_text() == "keep"


def test_existing_run_is_never_overwritten(tmp_path, capsys):
  run = tmp_path / "run"
  run.mkdir()
  cfg = load_config(DEBUG)
  save_config(cfg, run / "config.yaml")
  (run / "metrics.jsonl").write_text('{"step":0,"loss":1.0}\n')
  (run / "summary.json").write_text('{"status": "done"}')
  before = snapshot(run)
  rc, _, err = run_cli(capsys, "--config", DEBUG, "--out", str(run), "--quiet")
  assert rc == 2 and "--resume" in err and "never overwritten" in err, err
  # --resume with a different config is refused too
  rc, _, err = run_cli(capsys, "--config", DEBUG, "--out", str(run), "--resume", "--quiet",
                       "--set", "optim.lr=1e-2")
  assert rc == 2 and "config differs" in err, err
  assert snapshot(run) == before


def test_bad_config_exit_status_of_the_program(tmp_path):
  """The real program: exit status 2, one line on stderr, no traceback, nothing written."""
  out = tmp_path / "run"
  p = subprocess.run([sys.executable, "-m", "mhc_jax.cli", "train", "--config", DEBUG,
                      "--out", str(out), "--set", "model.heads=3"],
                     capture_output=True, text=True, timeout=120, cwd=tmp_path,
                     env=_env())
  assert p.returncode == 2, p.stderr
  assert p.stderr.strip() == "error: model.heads: 3 does not divide model.width=16"
  assert p.stdout == "" and not out.exists() and sorted(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- halt: exit 3

def test_nonfinite_halt_exit_3_with_checkpoint(tmp_path, capsys, fast_compile):
  run = tmp_path / "run"
  rc, out, err = run_cli(capsys, "--config", DEBUG, "--out", str(run), "--quiet", "--set",
                         "train.inject_nonfinite_at=2", "train.nonfinite=halt", "train.steps=5",
                         "train.diag_every=0", "train.ckpt_every=1", "train.keep_ckpts=2")
  assert rc == 3, err
  assert err.count("error: ") == 1 and "step 2" in err and "non-finite" in err, err
  assert str(run) in err  # where the checkpoint and logs are
  summary = json.loads((run / "summary.json").read_text())
  assert summary["status"] == "halted" and "step 2" in summary["message"], summary
  assert summary["nonfinite"] == 1 and summary["steps"] == 3
  recs = logs.read_jsonl(run / "metrics.jsonl")
  assert [r["step"] for r in recs] == [0, 1, 2]  # nothing after the bad step
  assert np.isnan(recs[2]["loss"]) and recs[2]["nonfinite"] == 1
  assert recs[2]["param_norm"] == recs[1]["param_norm"]
  # the halt checkpoint (the step counter past the bad batch) holds the parameters of step 2
  ckpts = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
  assert ckpts == [2, 3]
  before, halted = (ocp.StandardCheckpointer().restore(run / "checkpoints" / str(s) / "state")
                    for s in ckpts)
  assert int(halted["step"]) == 3 and int(halted["nonfinite"]) == 1
  jax.tree.map(np.testing.assert_array_equal, halted["params"], before["params"])
  jax.tree.map(np.testing.assert_array_equal, halted["opt_state"], before["opt_state"])


# --------------------------------------------------------------------------- metric names

def documented_metric_names() -> set[str]:
  text = (ROOT / "docs" / "interfaces.md").read_text()
  section = text.split("## Metric names in `metrics.jsonl`", 1)[1].split("\n## ", 1)[0]
  names = set(re.findall(r"`([a-z_/]+)`", section))
  return names - {"diag_every", "eval_every"}


@pytest.mark.slow
def test_quickstart_logs_every_documented_metric(tmp_path, capsys, fast_compile):
  names = documented_metric_names()
  assert {"loss", "grad_norm", "gain_fwd", "amax_fwd_composite", "eval/kl_bits"} <= names
  run = tmp_path / "qs"
  # the quickstart config, shortened: 2 steps, both with diagnostics, evaluation at the end
  rc, out, err = run_cli(capsys, "--config", QUICKSTART, "--out", str(run), "--set",
                         "train.steps=2", "optim.warmup_steps=1", "train.eval_every=2",
                         "data.eval_batches=1")
  assert rc == 0, err
  assert f"run directory: {run}" in out and f"logs: {run}/metrics.jsonl" in out, out
  recs = logs.read_jsonl(run / "metrics.jsonl")
  assert [r["step"] for r in recs] == [0, 1]
  logged = set().union(*recs)
  assert names <= logged, f"documented but not logged: {sorted(names - logged)}"
  last = recs[-1]
  depth = 2
  for k in ("gain_fwd", "amax_fwd", "amax_fwd_composite", "grad_rms", "sinkhorn_err"):
    assert len(last[k]) == 2 * depth, k
  for k in ("attn_logit_max", "layer_grad_norm"):
    assert len(last[k]) == depth, k
  summary = json.loads((run / "summary.json").read_text())
  assert summary["status"] == "done" and summary["steps"] == 2
  assert {"final_loss", "wall_s", "params", "nonfinite"} <= set(summary)


# --------------------------------------------------------------------------- kill and resume

def _env(cache_dir=None) -> dict:
  """One CPU device; with `cache_dir`, a persistent compilation cache the runs share."""
  env = dict(os.environ)
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
             JAX_DISABLE_MOST_OPTIMIZATIONS="1")
  if cache_dir is not None:
    env.update(JAX_COMPILATION_CACHE_DIR=str(cache_dir),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  return env


def _start(run, env, *extra):
  cmd = [sys.executable, "-m", "mhc_jax.cli", "train", "--out", str(run), "--quiet", *extra]
  return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)


def _last_step(run) -> int:
  try:
    recs = logs.read_jsonl(run / "metrics.jsonl")
  except (FileNotFoundError, ValueError):
    return -1
  return recs[-1]["step"] if recs else -1


def _signal_at(proc, run, step: int, sig) -> int:
  """Send `sig` once metrics.jsonl reaches `step`; returns the last logged step then."""
  deadline = time.monotonic() + 240
  while time.monotonic() < deadline:
    last = _last_step(run)
    if last >= step:
      proc.send_signal(sig)
      return last
    if proc.poll() is not None:
      pytest.fail(f"run ended (rc {proc.returncode}) before step {step}: {proc.stderr.read()}")
    time.sleep(0.005)
  proc.kill()
  pytest.fail(f"no step {step} within the deadline")


STEPS = 40  # tiny steps; enough that a run is still going when the signal arrives
TRAJ = ("loss", "grad_norm", "param_norm", "lr", "nonfinite")


@pytest.mark.slow
def test_sigkill_sigterm_and_resume_continue_the_same_trajectory(tmp_path):
  env = _env(tmp_path / "jax_cache")  # the four runs compile the step once
  conf = ["--config", DEBUG, "--set", f"train.steps={STEPS}", "train.ckpt_every=3",
          "train.log_every=1", "train.diag_every=0", "train.keep_ckpts=2"]
  ref_dir, run = tmp_path / "ref", tmp_path / "run"
  ref = _start(ref_dir, env, *conf)
  _, err = ref.communicate(timeout=300)
  assert ref.returncode == 0, err
  want = logs.read_jsonl(ref_dir / "metrics.jsonl")
  assert [r["step"] for r in want] == list(range(STEPS))

  rng = random.Random()
  kill_at = rng.randrange(4, 12)
  p = _start(run, env, *conf)
  _signal_at(p, run, kill_at, signal.SIGKILL)
  p.communicate(timeout=60)
  assert p.returncode == -signal.SIGKILL
  killed = _last_step(run)  # the kill lands a step or a few after kill_at
  assert killed < STEPS - 20, f"SIGKILL at step {kill_at} landed late, at step {killed}"
  # past what the killed run logged, so the signal reaches the resumed run's loop
  term_at = rng.randrange(killed + 2, killed + 10)
  where = f"(SIGKILL at step {kill_at}, last logged {killed}; SIGTERM at step {term_at})"

  p = _start(run, env, "--resume")  # the config comes from the run directory
  _signal_at(p, run, term_at, signal.SIGTERM)
  _, err = p.communicate(timeout=120)
  assert p.returncode == 143, f"{where} {err}"
  assert "SIGTERM" in err and "--resume" in err, err
  summary = json.loads((run / "summary.json").read_text())
  assert summary["status"] == "preempted", summary
  term_step = summary["steps"]  # the checkpoint SIGTERM saved
  assert (run / "checkpoints" / str(term_step)).is_dir()

  p = _start(run, env, "--resume", "--config", DEBUG, "--set", *conf[3:])
  out, err = p.communicate(timeout=120)
  assert p.returncode == 0, f"{where} {err}"
  assert f"done: {STEPS} steps" in out

  got = logs.read_jsonl(run / "metrics.jsonl")
  assert [r["step"] for r in got] == list(range(STEPS)), f"{where} every step exactly once"
  for key in TRAJ:
    np.testing.assert_allclose([r[key] for r in got], [r[key] for r in want], rtol=1e-6,
                               atol=0, err_msg=f"{key} {where}")
  summary = json.loads((run / "summary.json").read_text())
  assert summary["status"] == "done" and summary["steps"] == STEPS
  assert summary["final_loss"] == pytest.approx(want[-1]["loss"], rel=1e-6)
