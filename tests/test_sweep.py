"""Sweeps (mhc_jax.sweep.grid / runner): expansion, validation, dry run, manifest, resume.

The fast tests check the grid and the runner's bookkeeping without training. ``tiny_sweep``
(session-scoped, built once per test session even under xdist, shared with
test_notebooks.py) trains a 3-run sweep in a subprocess, SIGKILLs it during the second run,
re-runs it to completion, then re-runs it once more; the slow tests read what happened.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from mhc_jax import cli, logs, rundir
from mhc_jax.model.params import expected_params
from mhc_jax.sweep import grid, runner
from mhc_jax.train.config import ConfigError

REPO = Path(__file__).resolve().parents[1]
DEBUG = str(REPO / "configs" / "debug.yaml")
TINY_STEPS = 40


def _write(path: Path, data: dict) -> Path:
  path.write_text(yaml.safe_dump(data, sort_keys=False))
  return path


def _sweep(tmp_path: Path, **kw) -> Path:
  data = {
    "name": "t",
    "base": DEBUG,
    "set": {"model.mixer_options": {}},
    "axes": {"model.mixer": ["residual", "mhc"], "model.depth": [1, 2]},
  }
  data.update(kw)
  return _write(tmp_path / "sweep.yaml", data)


# =========================================================================== the grid
def test_expand_names_order_and_overrides(tmp_path):
  sw = grid.read_sweep(_sweep(tmp_path))
  assert [r.name for r in sw.runs] == [
    "mixer=residual,depth=1",
    "mixer=residual,depth=2",
    "mixer=mhc,depth=1",
    "mixer=mhc,depth=2",
  ]
  r = sw.run("mixer=mhc,depth=2")
  assert r.overrides == {"model.mixer": "mhc", "model.depth": 2}
  assert (r.cfg.model.mixer, r.cfg.model.depth, r.cfg.name) == ("mhc", 2, "t")
  assert r.cfg.model.width == 16  # from the base config
  assert sw.base_config["model"]["mixer_options"] == {}
  # --set applies after the file's `set`, to every run
  sw = grid.read_sweep(_sweep(tmp_path, set={"train.steps": 7}), ["train.steps=3", "optim.lr=1e-2"])
  assert {(r.cfg.train.steps, r.cfg.optim.lr) for r in sw.runs} == {(3, 1e-2)}


def test_arm_axis_crosses_named_variants(tmp_path):
  """``arm``: named variants that set several keys at once, crossed with the other axes."""
  arms = {
    "residual": {"model.mixer": "residual"},
    "mhc_sym": {"model.mixer": "mhc", "model.mixer_options": {"stream_init": "symmetric"}},
  }
  sw = grid.read_sweep(
    _sweep(tmp_path, axes={"arm": arms, "model.depth": [1, 2], "train.seed": [0, 1]}),
  )
  assert [r.name for r in sw.runs][:3] == [
    "arm=residual,depth=1,seed=0",
    "arm=residual,depth=1,seed=1",
    "arm=residual,depth=2,seed=0",
  ]
  r = sw.run("arm=mhc_sym,depth=2,seed=1")
  assert r.overrides == {
    "model.mixer": "mhc",
    "model.mixer_options.stream_init": "symmetric",
    "model.depth": 2,
    "train.seed": 1,
  }
  assert r.cfg.model.mixer_options == {"stream_init": "symmetric"}
  assert sw.run("arm=residual,depth=1,seed=0").cfg.model.mixer_options == {}
  sw = grid.read_sweep(
    _sweep(tmp_path, axes={"arm": arms, "train.seed": [0, 1]}, population=["train.seed"])
  )
  assert [len(g) for g in grid.population_groups(sw)] == [2, 2]
  regime = {"fast": {"optim.lr": 1e-2}, "slow": {"optim.lr": 1e-3, "optim.clip": 1.0}}
  sw = grid.read_sweep(_sweep(tmp_path, axes={"arm": arms, "regime": regime}))
  assert sw.run("arm=residual,regime=slow").overrides == {
    "model.mixer": "residual",
    "optim.lr": 1e-3,
    "optim.clip": 1.0,
  }
  with pytest.raises(ConfigError, match="axes.b.y: sets optim.lr, which another axis sets too"):
    grid.read_sweep(_sweep(tmp_path, axes={"a": regime, "b": {"y": {"optim.lr": 1.0}}}))


@pytest.mark.parametrize(
  "arm, where",
  [
    ({}, "axes.arm: named variants need a plain label and at least one variant"),
    ({"a/b": {"model.mixer": "hc"}}, "axes.arm: variant names must be file-name-safe"),
    ({"x": "hc"}, "axes.arm.x: expected a mapping of dotted overrides"),
    ({"x": {"model.depth": 2}}, "axes.arm.x: sets model.depth, which another axis sets too"),
    ({"x": {"model.mixer": "nope"}}, "axes.model.mixer: value 'nope'"),
  ],
)
def test_bad_arm_names_the_key(tmp_path, arm, where):
  with pytest.raises(ConfigError) as e:
    grid.read_sweep(_sweep(tmp_path, axes={"arm": arm, "model.depth": [1]}))
  assert where in str(e.value)


def test_names_are_filesystem_safe_and_disambiguated():
  names = grid.run_names(
    {
      "optim.lr": [3e-3, 1e-2],
      "train.seed": [0],
      "model.mixer_options": [{"n": 2}],
      "data.options.n_symbols": [4],
    }
  )
  assert names == [
    "lr=0.003,seed=0,mixer_options=n-2,n_symbols=4",
    "lr=0.01,seed=0,mixer_options=n-2,n_symbols=4",
  ]
  assert grid.run_names({"model.depth": [1], "data.depth": [2]}) == ["model.depth=1,data.depth=2"]
  for n in names:
    assert "/" not in n and " " not in n


def test_population_groups(tmp_path):
  sw = grid.read_sweep(
    _sweep(
      tmp_path,
      axes={"model.mixer": ["residual", "mhc"], "optim.lr": [1e-3, 3e-3], "train.seed": [0, 1]},
      population=["optim.lr", "train.seed"],
    )
  )
  groups = grid.population_groups(sw)
  assert [[r.name for r in g] for g in groups] == [
    [r.name for r in sw.runs[:4]],
    [r.name for r in sw.runs[4:]],
  ]
  assert all(r.overrides["model.mixer"] == "mhc" for r in groups[1])


@pytest.mark.parametrize(
  "kw, where",
  [
    ({"axes": {"model.mixer": ["residual", "nope"]}}, "axes.model.mixer: value 'nope'"),
    ({"axes": {"model.depth": [2, 0]}}, "axes.model.depth: value 0"),
    ({"axes": {"model.width": [16, 18]}}, "axes.model.width: value 18"),  # heads=2 -> odd head dim
    ({"axes": {"model.dept": [1]}}, "axes.model.dept"),
    ({"set": {"optim.lr": "fast"}}, "set.optim.lr"),
    ({"axes": {"model.depth": 4}}, "axes.model.depth: expected a non-empty list"),
    ({"population": ["model.depth"]}, "population.model.depth: cannot be trained as a population"),
    ({"population": ["optim.lr"]}, "population.optim.lr: not an axis"),
    ({"sweeps": 1}, "sweeps: unknown sweep key"),
    ({"base": "configs/nothere.yaml"}, "base: configs/nothere.yaml not found"),
    ({"eval": 0}, "eval: expected a positive number of validation batches, got 0"),
    ({"eval": "4"}, "eval: expected a positive number of validation batches, got '4'"),
    ({"eval": True}, "eval: expected a positive number of validation batches, got True"),
  ],
)
def test_bad_sweep_names_the_key(tmp_path, kw, where):
  with pytest.raises(ConfigError, match=None) as e:
    grid.read_sweep(_sweep(tmp_path, **kw))
  assert where in str(e.value)


@pytest.mark.parametrize("text", ["", "# nothing yet\n", "[1, 2]\n"])
def test_an_empty_or_non_mapping_sweep_file_is_an_error(tmp_path, text):
  """A sweep file with no sweep in it is a mistake, not a default run."""
  f = tmp_path / "empty.yaml"
  f.write_text(text)
  with pytest.raises(ConfigError, match="empty.yaml"):
    grid.read_sweep(f)


def test_eval_option_is_read(tmp_path):
  assert grid.read_sweep(_sweep(tmp_path, eval=3)).options == {"eval": 3}
  assert "eval" not in grid.read_sweep(_sweep(tmp_path)).options


def test_culprit_is_the_axis_without_which_the_run_is_valid(tmp_path):
  # heads=3 is fine with width 18 (base heads 2 is not): the error must name axes.model.heads
  with pytest.raises(ConfigError) as e:
    grid.read_sweep(
      _sweep(tmp_path, set={"model.rope": False}, axes={"model.width": [18], "model.heads": [3, 4]})
    )
  assert str(e.value).startswith("axes.model.heads: value 4 (run width=18,heads=4): model.heads")


def test_bad_axis_exits_2_and_writes_nothing(tmp_path, capsys):
  out = tmp_path / "out"
  f = _sweep(tmp_path, axes={"model.mixer": ["residual", "mhx"]})
  assert cli.main(["sweep", str(f), "--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert "error: axes.model.mixer: value 'mhx'" in err and "did you mean mhc" in err
  assert not out.exists()


def test_prepare_runs_shares_work_across_lrs_and_seeds(tmp_path, monkeypatch):
  """An lr x seed grid: one data source per seed, one shape check per model; each setup carries
  its own run's config, the one ``prepare`` alone gives it."""
  from mhc_jax import data
  from mhc_jax.train import loop

  axes = {"model.depth": [1, 2], "optim.lr": [1e-3, 3e-3, 1e-2], "train.seed": [0, 1]}
  sw = grid.read_sweep(_sweep(tmp_path, axes=axes))
  sources, shapes = [], []
  make_source, abstract_boxed = data.make_source, loop.abstract_boxed
  monkeypatch.setattr(
    data, "make_source", lambda *a, **k: sources.append(1) or make_source(*a, **k)
  )
  monkeypatch.setattr(loop, "abstract_boxed", lambda *a: shapes.append(1) or abstract_boxed(*a))
  monkeypatch.setattr(loop, "_SHAPES_CHECKED", set())
  setups = grid.prepare_runs(sw)
  assert len(sw.runs) == 12 and (len(sources), len(shapes)) == (4, 2)  # (depth, seed); depth
  for r in sw.runs:
    assert setups[r.name].cfg == loop.prepare(r.cfg).cfg
    assert setups[r.name].cfg.optim.lr == r.cfg.optim.lr


def test_dry_run_params_and_flops(tmp_path, capsys):
  out = tmp_path / "out"
  f = _sweep(tmp_path)
  assert cli.main(["sweep", str(f), "--out", str(out), "--dry-run"]) == 0
  text = capsys.readouterr().out
  assert not out.exists()
  sw = grid.read_sweep(f)
  setups = grid.prepare_runs(sw)
  table = grid.dry_run_table(sw, setups)
  for r, row in zip(sw.runs, table.itertuples()):
    m = setups[r.name].cfg.model  # vocab resolved from the data source
    assert m.vocab == 10
    p = expected_params(m)
    assert row.params == p["total"] and row.non_embedding == p["non_embedding"]
    c = setups[r.name].cfg
    tokens = c.train.steps * c.data.batch_size * c.data.seq_len
    n = p["non_embedding"] + m.vocab * m.width
    assert row.train_flops == tokens * (6 * n + 12 * m.depth * c.data.seq_len * m.width)
    assert r.name in text and f"{p['total']}" in text
  assert "training FLOPs" in text


# =========================================================================== bookkeeping
def test_manifest_written_atomically_and_readable(tmp_path):
  sw = grid.read_sweep(_sweep(tmp_path))
  manifest, todo, notes = runner.plan(sw, tmp_path / "s")
  assert todo == [r.name for r in sw.runs] and not notes
  runner.write_manifest(tmp_path / "s", manifest)
  assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["manifest.json"]  # no temp left
  m = json.loads((tmp_path / "s" / "manifest.json").read_text())
  assert m["runs"]["mixer=mhc,depth=2"] == {
    "status": "pending",
    "dir": "runs/mixer=mhc,depth=2",
    "overrides": {"model.mixer": "mhc", "model.depth": 2},
  }
  assert list(logs.load_summaries(tmp_path / "s")["run"]) == todo
  (tmp_path / "s" / "manifest.json").write_text("{not json")
  with pytest.raises(ConfigError, match="^--out: .*manifest.json is not valid JSON"):
    runner.plan(sw, tmp_path / "s")


def test_a_run_is_finished_when_its_summary_says_so(tmp_path):
  d = tmp_path / "run"
  assert runner.run_status(d) == ("pending", None)
  for status, want in [("done", "done"), ("diverged", "done"), ("preempted", "pending")]:
    rundir.write_summary(d, {"status": status})
    assert runner.run_status(d) == (want, None), status
  rundir.write_summary(d, {"status": "halted", "message": "non-finite loss at step 3"})
  assert runner.run_status(d) == ("failed", "non-finite loss at step 3")
  rundir.write_summary(d, {"status": "failed"})
  assert runner.run_status(d) == ("failed", "failed")


def test_a_dead_jobs_error_names_the_signal_not_the_last_log_line(tmp_path):
  """A job whose process died (an OOM kill) has no result; the error says how it died, not the
  last line of its stderr (a warning, as often as not)."""
  import subprocess
  import sys

  from submitit.core.utils import UncompletedJobError

  proc = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), 9)"])
  proc.wait()
  out = tmp_path / "7.out"
  out.write_text("mixer=hc: training from step 0\n")

  class DeadJob:  # what submitit's LocalJob shows of a process that was killed
    job_id, state, _process = "7", "INTERRUPTED", proc
    paths = type("P", (), {"stdout": out})()

    def stdout(self):
      return out.read_text()

  e = UncompletedJobError(
    "Job 7 (task: 0) with path r.pkl\nhas not produced any output (state: INTERRUPTED)\n"
    "Error stream produced:\n----\nWARNING:absl:Type handler registry type overriding"
  )
  msg = runner._job_error(DeadJob(), e)
  assert msg.startswith("job 7 died without a result (killed by SIGKILL)"), msg
  assert "WARNING" not in msg and "training from step 0" in msg
  assert runner._job_error(DeadJob(), ValueError("bad\nfinal line")).startswith(
    "job 7 failed: final line"
  )


def test_a_dead_job_leaves_a_failed_summary_saying_why(tmp_path):
  done, raised, killed = (tmp_path / n for n in ("done", "raised", "killed"))
  rundir.write_summary(done, {"status": "done", "steps": 5})
  rundir.write_summary(raised, {"status": "failed", "steps": 2})  # the loop's, on an exception
  rundir.write_summary(killed, {"status": "preempted", "steps": 3})  # then SIGKILLed on resume
  for d in (done, raised, killed):
    runner._fail(d, "job 7 failed: killed by SIGKILL")
  assert rundir.read_summary(done) == {"status": "done", "steps": 5}  # a finished run is kept
  assert runner.run_status(raised) == ("failed", "job 7 failed: killed by SIGKILL")
  assert rundir.read_summary(killed)["steps"] == 3
  assert runner.run_status(killed) == ("failed", "job 7 failed: killed by SIGKILL")


def test_changed_sweep_file(tmp_path):
  out = tmp_path / "s"
  sw = grid.read_sweep(_sweep(tmp_path))
  manifest, _, _ = runner.plan(sw, out)
  rundir.write_summary(out / "runs" / "mixer=residual,depth=1", {"status": "done"})
  rundir.write_summary(
    out / "runs" / "mixer=residual,depth=2", {"status": "failed", "message": "boom"}
  )
  runner.write_manifest(out, manifest)
  # a changed base value or a changed set of axis keys: refused, naming the key
  with pytest.raises(ConfigError, match=r"^optim.lr: changed from 0.003 to 0.01"):
    runner.plan(
      grid.read_sweep(_sweep(tmp_path, set={"model.mixer_options": {}, "optim.lr": 1e-2})), out
    )
  with pytest.raises(ConfigError, match=r"^axes.optim.lr: a new axis"):
    runner.plan(grid.read_sweep(_sweep(tmp_path, axes={**sw.axes, "optim.lr": [1e-3]})), out)
  with pytest.raises(ConfigError, match=r"^axes.model.depth: axis removed"):
    runner.plan(grid.read_sweep(_sweep(tmp_path, axes={"model.mixer": ["mhc"]})), out)
  # a new value: only the new runs are added; a removed value's runs are kept
  new = grid.read_sweep(
    _sweep(tmp_path, axes={"model.mixer": ["residual", "hc"], "model.depth": [1, 2]})
  )
  m, todo, notes = runner.plan(new, out)
  assert todo == ["mixer=hc,depth=1", "mixer=hc,depth=2"]  # done and failed are kept as they are
  assert m["runs"]["mixer=residual,depth=1"]["status"] == "done"
  assert m["runs"]["mixer=residual,depth=2"]["error"] == "boom"
  assert "mixer=mhc,depth=1" in m["runs"] and any("no longer in the sweep file" in n for n in notes)
  # a failed run whose directory was deleted is retried
  shutil.rmtree(out / "runs" / "mixer=residual,depth=2")
  _, todo, _ = runner.plan(new, out)
  assert "mixer=residual,depth=2" in todo


def test_a_changed_default_that_no_run_reads_does_not_block_resume(tmp_path):
  """optim.steps_exponent's default moved 0.25 -> 0.5 while a sweep without base_steps ran: its
  runs' configs (and hashes) are unchanged, so resuming is allowed; with base_steps set it is not."""
  out = tmp_path / "s"
  m, _, _ = runner.plan(grid.read_sweep(_sweep(tmp_path, set={"optim.steps_exponent": 0.25})), out)
  runner.write_manifest(out, m)
  runner.plan(grid.read_sweep(_sweep(tmp_path, set={"optim.steps_exponent": 0.5})), out)
  out2 = tmp_path / "s2"
  at = {"optim.base_steps": 100}
  m, _, _ = runner.plan(
    grid.read_sweep(_sweep(tmp_path, set={**at, "optim.steps_exponent": 0.25})), out2
  )
  runner.write_manifest(out2, m)
  with pytest.raises(ConfigError, match=r"^optim.steps_exponent: changed from 0.25 to 0.5"):
    runner.plan(grid.read_sweep(_sweep(tmp_path, set={**at, "optim.steps_exponent": 0.5})), out2)


# =========================================================================== a real sweep
def _shared_dir(tmp_path_factory) -> Path:
  """A directory all xdist workers of this session share."""
  base = tmp_path_factory.getbasetemp()
  return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _digest(path: Path) -> str:
  return hashlib.sha256(path.read_bytes()).hexdigest()


def _steps(path: Path) -> list[int]:
  return [r["step"] for r in logs.read_jsonl(path)]


def sweep_env(cache_dir: Path, **extra) -> dict:
  """The environment of the tiny sweeps' processes (this one and test_parallel_sweep's, whose
  logs are compared with it): their compilation cache, and XLA with most optimisations off
  (tiny runs are mostly compilation)."""
  return dict(
    os.environ,
    JAX_COMPILATION_CACHE_DIR=str(cache_dir),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    JAX_DISABLE_MOST_OPTIMIZATIONS="1",
    **extra,
  )


def _build_tiny_sweep(root: Path) -> dict:
  f = _write(
    root / "tiny.yaml",
    {
      "name": "tiny",
      "base": DEBUG,
      "set": {
        "model.mixer_options": {},
        "train.steps": TINY_STEPS,
        "train.diag_every": 1,
        "train.log_every": 1,
        "train.eval_every": 20,
        "train.ckpt_every": 10,
        "data.eval_batches": 1,
      },
      "axes": {"model.mixer": ["residual", "hc", "mhc"]},
    },
  )
  out = root / "sweep"
  env = sweep_env(root / "jax_cache")
  cmd = [sys.executable, "-m", "mhc_jax.cli", "sweep", str(f), "--out", str(out), "--quiet"]
  rec: dict = {"out": str(out)}
  victim = out / "runs" / "mixer=hc"

  # 1. start, and SIGKILL during the second run, once it has a checkpoint and has logged past it
  t0 = time.time()
  with open(root / "first.log", "w") as log:
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    while p.poll() is None and time.time() - t0 < 900:
      try:
        m = json.loads((out / "manifest.json").read_text())
        ck = {int(c.name) for c in (victim / "checkpoints").iterdir() if c.name.isdigit()}
        steps = _steps(victim / "metrics.jsonl")
      except (OSError, ValueError):
        time.sleep(0.05)
        continue
      if m["runs"]["mixer=hc"]["status"] == "running" and ck and steps and max(steps) > min(ck):
        os.kill(p.pid, signal.SIGSTOP)
        m = json.loads((out / "manifest.json").read_text())
        rec["at_kill"] = {
          "status": {n: i["status"] for n, i in m["runs"].items()},
          "ckpts": sorted(
            int(c.name) for c in (victim / "checkpoints").iterdir() if c.name.isdigit()
          ),
          "logged": _steps(victim / "metrics.jsonl"),
        }
        os.kill(p.pid, signal.SIGKILL)
        break
      time.sleep(0.05)
    p.wait()
  rec["first_s"] = time.time() - t0
  rec["first_log"] = (root / "first.log").read_text()[-3000:]
  rec["residual_digest"] = _digest(out / "runs" / "mixer=residual" / "metrics.jsonl")

  # 2. re-run: finishes the killed run and the one after it
  t0 = time.time()
  r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
  rec["second"] = {
    "rc": r.returncode,
    "out": r.stdout,
    "err": r.stderr[-3000:],
    "s": time.time() - t0,
  }
  rec["residual_digest_after"] = _digest(out / "runs" / "mixer=residual" / "metrics.jsonl")
  manifest_digest = _digest(out / "manifest.json")

  # 3. re-run a finished sweep: nothing to do, nothing written
  t0 = time.time()
  r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
  rec["third"] = {
    "rc": r.returncode,
    "out": r.stdout,
    "err": r.stderr[-3000:],
    "s": time.time() - t0,
  }
  rec["manifest_unchanged"] = _digest(out / "manifest.json") == manifest_digest
  return rec


@pytest.fixture(scope="session")
def tiny_sweep(tmp_path_factory) -> dict:
  """Build the tiny sweep once per session (xdist workers share it through a file lock)."""
  root = _shared_dir(tmp_path_factory) / "tiny_sweep"
  root.mkdir(exist_ok=True)
  with open(root / "lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    done = root / "record.json"
    if not done.exists():
      done.write_text(json.dumps(_build_tiny_sweep(root)))
    rec = json.loads(done.read_text())
  rec["out"] = Path(rec["out"])
  return rec


@pytest.mark.slow
def test_tiny_sweep_completes(tiny_sweep):
  out = tiny_sweep["out"]
  assert tiny_sweep["second"]["rc"] == 0, tiny_sweep["second"]
  m = json.loads((out / "manifest.json").read_text())
  assert {n: i["status"] for n, i in m["runs"].items()} == {
    "mixer=residual": "done",
    "mixer=hc": "done",
    "mixer=mhc": "done",
  }
  for name, info in m["runs"].items():
    rdir = out / info["dir"]
    assert json.loads((rdir / "summary.json").read_text())["status"] == "done"
    assert _steps(rdir / "metrics.jsonl") == list(range(TINY_STEPS)), name  # each step once
    df = logs.load_run(rdir)
    assert df["eval/kl_bits"].notna().sum() == TINY_STEPS // 20
  assert (out / "report" / "summary.md").exists()
  text = tiny_sweep["second"]["out"]
  assert f"report: {out / 'report' / 'summary.md'}" in text
  assert "| hc |" in text and "| eval_loss |" in text  # the screen-sized summary table
  assert f"Every column, with its definition: {out / 'report' / 'summary.csv'}" in text
  assert "max_grad_norm" not in text  # the full table is the CSV, not the screen
  from mhc_jax.sweep import report

  assert report.finding(report.summary_table(out)) in text  # the computed sentence, printed


@pytest.mark.slow
def test_killed_sweep_finishes_only_the_rest(tiny_sweep):
  at_kill = tiny_sweep.get("at_kill")
  assert at_kill, f"the sweep was not caught during its second run: {tiny_sweep['first_log']}"
  assert at_kill["status"] == {
    "mixer=residual": "done",
    "mixer=hc": "running",
    "mixer=mhc": "pending",
  }
  assert max(at_kill["logged"]) > min(at_kill["ckpts"])  # logs past a checkpoint were there
  out = tiny_sweep["second"]["out"]
  resumed = max(at_kill["ckpts"])
  assert f"mixer=hc: resuming from step {resumed}" in out, out
  assert "mixer=mhc: starting" in out
  assert "mixer=residual: starting" not in out and "mixer=residual: resuming" not in out
  assert tiny_sweep["residual_digest"] == tiny_sweep["residual_digest_after"]  # untouched
  hc = tiny_sweep["out"] / "runs" / "mixer=hc"
  assert _steps(hc / "metrics.jsonl") == list(range(TINY_STEPS))
  ev = logs.read_jsonl(hc / "events.jsonl") if (hc / "events.jsonl").exists() else []
  assert len({(e["step"], e["kind"]) for e in ev}) == len(ev)  # no event twice


@pytest.mark.slow
def test_rerunning_a_finished_sweep_does_nothing(tiny_sweep):
  third = tiny_sweep["third"]
  assert third["rc"] == 0, third
  assert "all 3 runs are finished (3 done, 0 failed); nothing to do" in third["out"]
  assert "starting" not in third["out"] and "resuming" not in third["out"]
  assert tiny_sweep["manifest_unchanged"]


_CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SWEEP_FILES = sorted(
  [*(_CONFIGS / "sweeps").glob("*.yaml"), *(_CONFIGS / "studies").glob("*.yaml")]
)


@pytest.mark.parametrize("path", SWEEP_FILES, ids=lambda p: p.name)
def test_every_shipped_sweep_file_expands_and_validates(path):
  sweep = grid.read_sweep(path)
  assert len(sweep.runs) >= 2
  assert path.read_text().lstrip().startswith("#")  # the header says how to run it, its cost
