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
  return {
    str(p.relative_to(path)): (p.read_bytes(), p.stat().st_mtime_ns)
    for p in sorted(path.rglob("*"))
    if p.is_file()
  }


# --------------------------------------------------------------------------- bad input


def _file(name, text):
  """A maker of a file ``name`` holding ``text`` in the test's directory."""

  def make(tmp):
    p = tmp / name
    p.write_text(text)
    return p

  return make


def _sweep(data: dict):
  import yaml

  return _file("sweep.yaml", yaml.safe_dump({"name": "s", "base": DEBUG, **data}))


def _corpus(tmp):
  p = tmp / "corpus.txt"
  p.write_text("abcdefgh" * 250)  # 2000 bytes
  return p


def _train(maker=None, *extra):
  """argv of `mhc-jax train`: the config from `maker` (default configs/debug.yaml), `extra`;
  an item of `extra` may be a function of the test's directory."""

  def argv(tmp):
    config = str(maker(tmp)) if maker else DEBUG
    rest = [x(tmp) if callable(x) else x for x in extra]
    return ["train", "--config", config, "--out", str(tmp / "run"), "--quiet", *rest]

  return argv


def _cmd(*words):
  def argv(tmp):
    return [str(w(tmp)) if callable(w) else w for w in words]

  return argv


# (id, argv maker, text the one error line must contain). Each: exit 2, one `error:` line on
# stderr, no traceback, nothing on stdout, nothing written.
BAD = [
  # config keys, types and values
  ("unknown key", _train(None, "--set", "model.dept=2"), "model.dept"),
  ("unknown section", _train(None, "--set", "modle.depth=2"), "modle"),
  ("wrong type", _train(None, "--set", "model.depth=two"), "model.depth"),
  ("bool for an int", _train(None, "--set", "model.depth=true"), "model.depth"),
  ("float for an int", _train(None, "--set", "model.width=16.5"), "model.width"),
  ("section not a mapping", _train(None, "--set", "model=3"), "model: expected a mapping"),
  ("heads do not divide width", _train(None, "--set", "model.heads=3"), "model.heads"),
  (
    "odd head dim with rope",
    _train(None, "--set", "model.width=30", "model.heads=2"),
    "model.rope",
  ),
  ("zero depth", _train(None, "--set", "model.depth=0"), "model.depth"),
  ("unknown remat", _train(None, "--set", "model.remat=partial"), "model.remat"),
  ("unknown dtype", _train(None, "--set", "model.dtype=fp16"), "model.dtype"),
  ("vocab below the data's", _train(None, "--set", "model.vocab=4"), "model.vocab"),
  ("unknown mixer", _train(None, "--set", "model.mixer=mhcc"), "model.mixer"),
  (
    "bad mixer option value",
    _train(None, "--set", "model.mixer=mhc", "model.mixer_options.sinkhorn_iters=0"),
    "model.mixer_options.sinkhorn_iters",
  ),
  (
    "mixer option of the wrong type",
    _train(None, "--set", "model.mixer=mhc", "model.mixer_options.n=two"),
    "model.mixer_options.n",
  ),
  (
    "option of another mixer",
    _train(None, "--set", "model.mixer=hc", "model.mixer_options.sinkhorn_iters=5"),
    "model.mixer_options.sinkhorn_iters",
  ),
  (
    "residual with two streams",
    _train(None, "--set", "model.mixer_options.n=2"),
    "model.mixer_options.n",
  ),
  (
    "mhc_lite beyond 6 streams",
    _train(None, "--set", "model.mixer=mhc_lite", "model.mixer_options.n=7"),
    "model.mixer_options",
  ),
  ("unknown data task", _train(None, "--set", "data.task=images"), "data.task"),
  ("zero seq_len", _train(None, "--set", "data.seq_len=0"), "data.seq_len"),
  ("zero batch", _train(None, "--set", "data.batch_size=0"), "data.batch_size"),
  (
    "unknown data option",
    _train(None, "--set", "data.options.n_symbol=4"),
    "data.options.n_symbol",
  ),
  (
    "posterior target without a posterior",
    _train(None, "--set", "data.task=text", "data.target=posterior"),
    "data.target",
  ),
  (
    "evaluation with no batches",
    _train(None, "--set", "train.eval_every=2", "data.eval_batches=0"),
    "data.eval_batches",
  ),
  (
    "no validation window",
    _train(
      None,
      "--set",
      "data.task=text",
      "train.eval_every=1",
      lambda tmp: 'data.options={"path": "%s", "val_fraction": 0.001}' % _corpus(tmp),
    ),
    "data.options",
  ),
  ("negative lr", _train(None, "--set", "optim.lr=-1e-3"), "optim.lr"),
  ("nan lr", _train(None, "--set", "optim.lr=.nan"), "optim.lr"),
  ("schedule typo", _train(None, "--set", "optim.schedule=cosin"), "optim.schedule"),
  ("warmup beyond steps", _train(None, "--set", "optim.warmup_steps=50"), "optim.warmup_steps"),
  ("negative clip", _train(None, "--set", "optim.clip=-1"), "optim.clip"),
  ("b2 of 1", _train(None, "--set", "optim.b2=1.0"), "optim.b2"),
  ("zero steps", _train(None, "--set", "train.steps=0"), "train.steps"),
  ("zero checkpoints kept", _train(None, "--set", "train.keep_ckpts=0"), "train.keep_ckpts"),
  ("unknown nonfinite policy", _train(None, "--set", "train.nonfinite=ignore"), "train.nonfinite"),
  ("train.population is no key", _train(None, "--set", "train.population={}"), "train.population"),
  ("tensorboard not a bool", _train(None, "--set", "train.tensorboard=maybe"), "train.tensorboard"),
  ("mesh does not match devices", _train(None, "--set", "mesh.data=3"), "mesh"),
  ("two mesh axes -1", _train(None, "--set", "mesh.fsdp=-1"), "mesh"),
  ("batch not divisible by mesh", _train(None, "--set", "data.batch_size=12"), "data.batch_size"),
  ("name with a slash", _train(None, "--set", "name=a/b"), "name"),
  # overrides and flags
  ("override without =", _train(None, "--set", "model.depth"), "model.depth"),
  ("override with a malformed key", _train(None, "--set", "a..b=1"), "malformed dotted key"),
  ("override value not YAML", _train(None, "--set", "model.depth=[1, 2"), "cannot parse override"),
  ("unknown flag", _train(None, "--bogus"), "--bogus"),
  ("int flag not an int", _train(None, "--num-processes", "two"), "--num-processes"),
  (
    "process id out of range",
    _train(None, "--num-processes", "2", "--process-id", "2"),
    "dist.process_id",
  ),
  ("malformed coordinator", _train(None, "--coordinator", "nohostport"), "dist.coordinator"),
  ("--resume without --out", _cmd("train", "--config", DEBUG, "--resume"), "--resume needs"),
  ("no --config", _cmd("train", "--out", lambda tmp: tmp / "run"), "--config is required"),
  # config files
  (
    "malformed yaml",
    _train(_file("bad.yaml", "model:\n  depth: [1, 2\n  width: 16\n")),
    "invalid YAML at line",
  ),
  (
    "yaml not a mapping",
    _train(_file("list.yaml", "- model\n- data\n")),
    "top level must be a mapping",
  ),
  (
    "duplicate yaml key",
    _train(_file("dup.yaml", "model:\n  depth: 1\n  depth: 2\n")),
    "duplicate key 'depth'",
  ),
  (
    "unknown key in the file",
    _train(_file("typo.yaml", "trian:\n  steps: 3\n")),
    "trian: unknown key",
  ),
  ("missing config file", _train(lambda tmp: tmp / "nope.yaml"), "nope.yaml: not found"),
  ("config is a directory", _train(lambda tmp: tmp), "is a directory"),
  # paths
  (
    "missing data path",
    _train(None, "--set", "data.task=text", 'data.options={"path": "/nonexistent/corpus"}'),
    "data.options.path",
  ),
  (
    "data glob matches nothing",
    _train(None, "--set", "data.task=text", 'data.options={"path": "/nonexistent/*.txt"}'),
    "matches no files",
  ),
  ("--out is a file", _cmd("train", "--config", DEBUG, "--out", _corpus), "not a directory"),
  (
    "--resume on no run",
    _cmd("train", "--resume", "--out", lambda tmp: tmp / "none"),
    "not a run directory",
  ),
  ("report of no directory", _cmd("report", lambda tmp: tmp / "nosweep"), "not a directory"),
  # sweep files
  (
    "sweep file missing",
    _cmd("sweep", lambda tmp: tmp / "nope.yaml", "--out", lambda tmp: tmp / "sw"),
    "nope.yaml",
  ),
  (
    "sweep axis unknown key",
    _cmd("sweep", _sweep({"axes": {"model.dept": [1, 2]}}), "--out", lambda tmp: tmp / "sw"),
    "model.dept",
  ),
  (
    "sweep axis bad value",
    _cmd("sweep", _sweep({"axes": {"model.depth": [1, "two"]}}), "--out", lambda tmp: tmp / "sw"),
    "axes.model.depth",
  ),
  (
    "sweep population of a shape axis",
    _cmd(
      "sweep",
      _sweep({"axes": {"model.depth": [1, 2]}, "population": ["model.depth"]}),
      "--out",
      lambda tmp: tmp / "sw",
    ),
    "population.model.depth",
  ),
  (
    "sweep unknown top-level key",
    _cmd("sweep", _sweep({"axis": {"model.depth": [1]}}), "--out", lambda tmp: tmp / "sw"),
    "axis",
  ),
  (
    "sweep bad set value",
    _cmd(
      "sweep",
      _sweep({"set": {"optim.lr": "fast"}, "axes": {"model.depth": [1]}}),
      "--out",
      lambda tmp: tmp / "sw",
    ),
    "optim.lr",
  ),
]


def _snapshot_tree(tmp) -> list:
  return sorted(
    (str(p.relative_to(tmp)), p.stat().st_size if p.is_file() else -1) for p in tmp.rglob("*")
  )


@pytest.mark.parametrize("argv,key", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_one_message_exit_2_nothing_written(argv, key, tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(tmp_path)  # a default run directory would appear under ./runs
  args = argv(tmp_path)
  before = _snapshot_tree(tmp_path)
  try:
    rc = cli.main(args)
  except SystemExit as e:  # argparse's own exit, through cli's one-line error
    rc = e.code
  stdout, stderr = capsys.readouterr()
  assert rc == 2, stderr
  lines = stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), stderr
  assert key in lines[0], lines[0]
  assert "Traceback" not in stderr and stdout == ""
  assert _snapshot_tree(tmp_path) == before


def test_the_bad_input_list_is_long():
  assert len(BAD) >= 40 and len({b[0] for b in BAD}) == len(BAD)


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
  rc, _, err = run_cli(
    capsys, "--config", DEBUG, "--out", str(run), "--resume", "--quiet", "--set", "optim.lr=1e-2"
  )
  assert rc == 2 and "config differs" in err, err
  assert snapshot(run) == before


def test_bad_config_exit_status_of_the_program(tmp_path):
  """The real program: exit status 2, one line on stderr, no traceback, nothing written."""
  out = tmp_path / "run"
  p = subprocess.run(
    [
      sys.executable,
      "-m",
      "mhc_jax.cli",
      "train",
      "--config",
      DEBUG,
      "--out",
      str(out),
      "--set",
      "model.heads=3",
    ],
    capture_output=True,
    text=True,
    timeout=120,
    cwd=tmp_path,
    env=_env(),
  )
  assert p.returncode == 2, p.stderr
  assert p.stderr.strip() == "error: model.heads: 3 does not divide model.width=16"
  assert p.stdout == "" and not out.exists() and sorted(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- halt: exit 3


def test_nonfinite_halt_exit_3_with_checkpoint(tmp_path, capsys, monkeypatch):
  """A NaN loss at step 2 (the test wraps the data source: faults.NanAt) under policy halt."""
  import dataclasses

  from faults import NanAt

  from mhc_jax.train import loop

  real = loop.prepare

  def prepare(*args, **kwargs):
    setup = real(*args, **kwargs)
    return dataclasses.replace(setup, source=NanAt(setup.source, 2))

  monkeypatch.setattr(loop, "prepare", prepare)
  run = tmp_path / "run"
  rc, out, err = run_cli(
    capsys,
    "--config",
    DEBUG,
    "--out",
    str(run),
    "--quiet",
    "--set",
    "train.nonfinite=halt",
    "train.steps=5",
    "train.diag_every=0",
    "train.ckpt_every=1",
    "train.keep_ckpts=2",
  )
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
  before, halted = (
    ocp.StandardCheckpointer().restore(run / "checkpoints" / str(s) / "state") for s in ckpts
  )
  assert int(halted["step"]) == 3 and int(halted["nonfinite"]) == 1
  jax.tree.map(np.testing.assert_array_equal, halted["params"], before["params"])
  jax.tree.map(np.testing.assert_array_equal, halted["opt_state"], before["opt_state"])


def test_resume_of_a_finished_run_changes_nothing(tmp_path, capsys):
  """Defect: --resume on a finished run rewrote summary.json with final_loss NaN."""
  run = tmp_path / "run"
  rc, _, err = run_cli(
    capsys, "--config", DEBUG, "--out", str(run), "--quiet", "--set", "train.diag_every=0"
  )
  assert rc == 0, err
  before = snapshot(run)
  summary = json.loads((run / "summary.json").read_text())
  assert summary["status"] == "done" and np.isfinite(summary["final_loss"])
  rc, out, err = run_cli(capsys, "--out", str(run), "--resume", "--quiet")
  assert rc == 0, err
  assert f"final loss {summary['final_loss']:.4f}" in out
  assert snapshot(run) == before


def test_halt_on_divergence_logs_every_update_it_applied(tmp_path, capsys):
  """Defects: the divergence rule never saw non-finite losses; and a halt seen one step late
  (the host logs one step behind the device) applied an update it never logged, so the
  checkpoint was one step past the logs. lr 1e30: every update from step 2 on is non-finite
  and skipped; after 5 in a row (the rule's patience) the run diverges at step 6."""
  run = tmp_path / "run"
  rc, _, err = run_cli(
    capsys,
    "--config",
    DEBUG,
    "--out",
    str(run),
    "--quiet",
    "--set",
    "optim.lr=1e30",
    "train.steps=12",
    "train.halt_on_divergence=true",
    "train.diag_every=0",
    "train.ckpt_every=0",
  )
  assert rc == 3, err
  assert err.count("error: ") == 1 and "diverged at step 6 (nonfinite)" in err, err
  steps = [r["step"] for r in logs.read_jsonl(run / "metrics.jsonl")]
  ckpts = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
  assert steps == list(range(len(steps))) and steps[-1] >= 6
  assert ckpts[-1] == steps[-1] + 1, (steps, ckpts)  # every applied update is logged
  state = ocp.StandardCheckpointer().restore(run / "checkpoints" / str(ckpts[-1]) / "state")
  assert int(state["step"]) == ckpts[-1]
  events = logs.read_jsonl(run / "events.jsonl")
  div = [e for e in events if e["kind"] == "divergence"]
  assert [(e["step"], e["reason"]) for e in div] == [(6, "nonfinite")]
  assert [e["step"] for e in events if e["kind"] == "nonfinite"] == list(range(2, steps[-1] + 1))
  summary = json.loads((run / "summary.json").read_text())
  assert summary["status"] == "halted" and summary["steps"] == ckpts[-1]
  assert summary["divergence"] == {"step": 6, "reason": "nonfinite"}
  # a halted run resumed changes nothing: the policy would stop it again
  before = snapshot(run)
  rc, _, err = run_cli(capsys, "--out", str(run), "--resume", "--quiet")
  assert rc == 3 and "diverged at step 6" in err, err
  assert snapshot(run) == before


# --------------------------------------------------------------------------- metric names


def documented_metric_names() -> set[str]:
  """The names in docs/interfaces.md's metric table (generated from mhc_jax.metrics), those
  logged every step, at diagnostic steps or at evaluations."""
  from mhc_jax import metrics

  text = (ROOT / "docs" / "interfaces.md").read_text()
  in_docs = set(re.findall(r"^\| `([a-z_/]+)`", text, flags=re.M))
  logged = {m.name for m in metrics.METRICS if m.when in ("step", "diag", "eval")}
  return in_docs & logged


@pytest.mark.slow
def test_quickstart_logs_every_documented_metric(tmp_path, capsys):
  names = documented_metric_names()
  assert {"loss", "grad_norm", "gain_fwd", "amax_fwd_composite", "eval/kl_bits"} <= names
  run = tmp_path / "qs"
  # the quickstart config, shortened: 2 steps, both with diagnostics, evaluation at the end
  rc, out, err = run_cli(
    capsys,
    "--config",
    QUICKSTART,
    "--out",
    str(run),
    "--set",
    "train.steps=2",
    "optim.warmup_steps=1",
    "train.eval_every=2",
    "data.eval_batches=1",
  )
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
  """One CPU device (the session's other XLA flags kept); with `cache_dir`, a persistent
  compilation cache the runs share."""
  env = dict(os.environ)
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
  env.update(
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=1".strip(),
    JAX_DISABLE_MOST_OPTIMIZATIONS="1",
  )
  if cache_dir is not None:
    env.update(
      JAX_COMPILATION_CACHE_DIR=str(cache_dir),
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
  return env


def _start(run, env, *extra):
  cmd = [sys.executable, "-m", "mhc_jax.cli", "train", "--out", str(run), "--quiet", *extra]
  return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _last_step(run) -> int:
  try:
    recs = logs.read_jsonl(run / "metrics.jsonl")
  except (FileNotFoundError, ValueError):
    return -1
  return recs[-1]["step"] if recs else -1


def _signal_at(proc, run, step: int, sig) -> int:
  """Send `sig` (None: none) once metrics.jsonl reaches `step`; returns the last logged step."""
  deadline = time.monotonic() + 240
  while time.monotonic() < deadline:
    last = _last_step(run)
    if last >= step:
      if sig is not None:
        proc.send_signal(sig)
      return last
    if proc.poll() is not None:
      pytest.fail(f"run ended (rc {proc.returncode}) before step {step}: {proc.stderr.read()}")
    time.sleep(0.005)
  proc.kill()
  pytest.fail(f"no step {step} within the deadline")


def _ckpt_steps(run) -> list[int]:
  d = run / "checkpoints"
  return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


STEPS = 60  # tiny steps; enough that a run is still going when the signals arrive
TRAJ = ("loss", "grad_norm", "param_norm", "lr", "nonfinite")


@pytest.mark.slow
def test_five_sigkills_a_sigterm_and_resumes_give_the_uninterrupted_run(tmp_path):
  """Five SIGKILLs at random moments (a few steps past the newest checkpoint, plus up to 50 ms:
  in a step, between steps, in an asynchronous checkpoint save), each followed by --resume,
  then a SIGTERM and a last --resume: every step is logged once and the logged trajectory is
  the uninterrupted run's. While one of the runs is alive a second trainer on the same run
  directory exits 2 naming it (the directory is locked; a killed trainer's lock goes with it)."""
  env = _env(tmp_path / "jax_cache")  # the runs compile the step once
  conf = [
    "--config",
    DEBUG,
    "--set",
    f"train.steps={STEPS}",
    "train.ckpt_every=3",
    "train.log_every=1",
    "train.diag_every=0",
    "train.keep_ckpts=2",
  ]
  ref_dir, run = tmp_path / "ref", tmp_path / "run"
  ref = _start(ref_dir, env, *conf)
  _, err = ref.communicate(timeout=300)
  assert ref.returncode == 0, err
  want = logs.read_jsonl(ref_dir / "metrics.jsonl")
  assert [r["step"] for r in want] == list(range(STEPS))

  rng = random.Random()
  where = []
  p = _start(run, env, *conf)
  for i in range(5):
    # past what earlier attempts logged: the signal reaches this attempt's loop
    kill_at = max(_last_step(run), max(_ckpt_steps(run), default=0)) + rng.randrange(1, 5)
    _signal_at(p, run, kill_at, None)  # wait for the step, then up to 50 ms more
    time.sleep(rng.uniform(0.0, 0.05))
    if i == 1:  # the run is alive (paused, so it cannot finish): a second trainer is refused
      p.send_signal(signal.SIGSTOP)
      other = subprocess.run(
        [sys.executable, "-m", "mhc_jax.cli", "train", "--out", str(run), "--resume", "--quiet"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
      )
      assert other.returncode == 2, other.stderr[-2000:]
      lines = other.stderr.strip().splitlines()
      assert len(lines) == 1 and f"in use by pid {p.pid}" in lines[0], other.stderr[-2000:]
    p.kill()
    p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL
    where.append((kill_at, _last_step(run)))
    assert _last_step(run) < STEPS - 1, f"SIGKILLs {where} landed after the end"
    p = _start(run, env, "--resume")  # the config comes from the run directory
  term_at = _last_step(run) + rng.randrange(2, 6)
  _signal_at(p, run, term_at, signal.SIGTERM)
  _, err = p.communicate(timeout=120)
  where = f"(SIGKILLs at steps {where}; SIGTERM at step {term_at})"
  assert p.returncode == 143, f"{where} {err}"
  assert "SIGTERM" in err and "--resume" in err, err
  summary = json.loads((run / "summary.json").read_text())
  assert summary["status"] == "preempted", summary
  assert summary["steps"] in _ckpt_steps(run)  # the checkpoint SIGTERM saved

  p = _start(run, env, "--resume", "--config", DEBUG, "--set", *conf[3:])
  out, err = p.communicate(timeout=120)
  assert p.returncode == 0, f"{where} {err}"
  assert f"done: {STEPS} steps" in out

  got = logs.read_jsonl(run / "metrics.jsonl")
  assert [r["step"] for r in got] == list(range(STEPS)), f"{where} every step exactly once"
  for key in TRAJ:
    np.testing.assert_allclose(
      [r[key] for r in got], [r[key] for r in want], rtol=1e-6, atol=0, err_msg=f"{key} {where}"
    )
  summary = json.loads((run / "summary.json").read_text())
  assert summary["status"] == "done" and summary["steps"] == STEPS
  assert summary["final_loss"] == pytest.approx(want[-1]["loss"], rel=1e-6)
  assert not (run / ".lock").exists()
