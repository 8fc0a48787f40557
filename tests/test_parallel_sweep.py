"""Parallel sweeps (mhc_jax.sweep.runner through submitit): bad input, the sweep file's settings,
GPUs split between local jobs, and -- in submitit's LocalExecutor -- a sweep whose whole process
group is SIGKILLed while runs train, then re-run: every run is trained exactly once, to the end.

The slow test shares one session fixture, ``killed_sweep`` (built once; xdist workers share it
through a file lock). Its runs are those of ``test_sweep.tiny_sweep`` (same configs), the
sequential reference its logs must equal.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from test_sweep import (  # noqa: F401
  DEBUG,
  REPO,
  TINY_STEPS,
  _digest,
  _shared_dir,
  _steps,
  sweep_env,
  tiny_sweep,
)

from mhc_jax import cli, logs
from mhc_jax.sweep import grid, options as how, runner
from mhc_jax.train.config import ConfigError

TIMING = ("tokens_per_s", "step_time_s")


def _tiny_file(root: Path, name: str, mixers: list[str], **extra) -> Path:
  data = {
    "name": name,
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
    "axes": {"model.mixer": mixers},
    **extra,
  }
  path = root / f"{name}.yaml"
  path.write_text(yaml.safe_dump(data, sort_keys=False))
  return path


# =========================================================================== bad input
@pytest.mark.parametrize(
  "flags, msg",
  [
    (["--parallel", "0"], "error: --parallel: expected a positive integer, got '0'"),
    (["--parallel", "two"], "error: --parallel: expected a positive integer, got 'two'"),
    (["--parallel", "-1"], "error: --parallel: expected a positive integer, got '-1'"),
    (["--parallel", "1.5"], "error: --parallel: expected a positive integer, got '1.5'"),
    (["--parallel", "2", "--executor", "ray"], "error: --executor: unknown executor 'ray'"),
    (["--executor", "process"], "error: --executor: unknown executor 'process'"),
    (["--parallel", "2", "--coordinator", "h:1"], "error: --coordinator: a parallel sweep"),
  ],
)
def test_bad_flags_exit_2_and_write_nothing(tmp_path, capsys, flags, msg):
  f = _tiny_file(tmp_path, "t", ["residual", "mhc"])
  out = tmp_path / "out"
  assert cli.main(["sweep", str(f), "--out", str(out), *flags]) == 2
  err = capsys.readouterr().err
  assert err.startswith(msg) and len(err.strip().splitlines()) == 1, err
  assert not out.exists()


@pytest.mark.parametrize(
  "extra, msg",
  [
    ({"parallel": 0}, "parallel: expected a positive integer, got 0"),
    ({"parallel": "many"}, "parallel: expected a positive integer, got 'many'"),
    ({"executor": {"kind": "pbs"}}, "executor.kind: unknown executor 'pbs'"),
    (
      {"executor": {"kind": "slurm", "slurm_partitio": "gpu"}},
      "executor.slurm_partitio: not a submitit",
    ),
    (
      {"executor": {"kind": "local", "timeout_mi": 5}},
      "executor.timeout_mi: not a submitit parameter for local",
    ),
    ({"executor": {"kind": "local", "folder": "x"}}, "executor.folder: the submitit folder"),
  ],
)
def test_bad_sweep_file_settings(tmp_path, capsys, extra, msg):
  f = _tiny_file(tmp_path, "t", ["residual"], **extra)
  out = tmp_path / "out"
  assert cli.main(["sweep", str(f), "--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"error: {msg}") and len(err.strip().splitlines()) == 1, err
  assert not out.exists()


def test_slurm_without_sbatch_is_bad_input(tmp_path, capsys, monkeypatch):
  monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch anywhere
  f = _tiny_file(tmp_path, "t", ["residual"])
  assert cli.main(["sweep", str(f), "--out", str(tmp_path / "o"), "--executor", "slurm"]) == 2
  assert "error: --executor slurm: sbatch not found" in capsys.readouterr().err
  assert not (tmp_path / "o").exists()


def test_mesh_is_checked_against_one_workers_devices(tmp_path):
  sw = grid.read_sweep(
    _tiny_file(tmp_path, "t", ["residual", "mhc"], set={"model.mixer_options": {}, "mesh.data": 4})
  )
  runner.check_runs(sw, 4)
  with pytest.raises(
    ConfigError,
    match=r"^run mixer=residual: mesh.*each of the parallel jobs "
    r"has 2 device",
  ):
    runner.check_runs(sw, 2)


def test_sweep_file_parallel_setting_is_read(tmp_path):
  sw = grid.read_sweep(
    _tiny_file(
      tmp_path,
      "t",
      ["residual"],
      parallel=3,
      executor={"kind": "local", "timeout_min": 30},
    )
  )
  assert sw.options == {"parallel": 3, "executor": {"kind": "local", "timeout_min": 30}}
  assert how.executor_options(sw.options["executor"], None) == ("local", {"timeout_min": 30})
  assert how.executor_options(None, None) == ("local", {})
  # the flag wins; the file's parameters were for another kind
  assert how.executor_options({"kind": "local", "visible_gpus": [0]}, "slurm") == ("slurm", {})
  assert grid.read_sweep(_tiny_file(tmp_path, "u", ["residual"])).options == {}


def test_local_jobs_split_the_visible_gpus(monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "")
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
  assert runner.devices_per_job(2, "local", {}) == (2, [[4, 5], [6, 7]])
  assert runner.devices_per_job(3, "local", {}) == (1, [[4], [5], [6]])
  with pytest.raises(ConfigError, match="--parallel: 5 runs at once need at least 5 GPUs"):
    runner.devices_per_job(5, "local", {})
  assert runner.devices_per_job(4, "slurm", {"gpus_per_node": 8}) == (8, [])
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # CPU: every job has the parent's device count
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  assert runner.devices_per_job(2, "local", {}) == (8, [[], []])


# =========================================================================== killed and re-run
def _wait_for(pred, timeout: float, what: str):
  t0 = time.time()
  while time.time() - t0 < timeout:
    v = pred()
    if v:
      return v
    time.sleep(0.1)
  raise TimeoutError(what)


def _mid_run(out: Path, name: str):
  """The run's checkpoints once it is training (its lock held) and has logged past one."""
  rdir = out / "runs" / name
  try:
    ck = {int(c.name) for c in (rdir / "checkpoints").iterdir() if c.name.isdigit()}
    steps = _steps(rdir / "metrics.jsonl")
  except (OSError, ValueError):
    return None
  busy = (rdir / ".lock").exists() and not (rdir / "summary.json").exists()
  return sorted(ck) if busy and ck and steps and max(steps) > min(ck) else None


def _done(out: Path, name: str) -> bool:
  try:
    return json.loads((out / "runs" / name / "summary.json").read_text())["status"] == "done"
  except (OSError, ValueError):
    return False


def _build_killed(root: Path) -> dict:
  f = _tiny_file(root, "tinypar", ["residual", "hc", "mhc"])
  out = root / "sweep"
  env = sweep_env(root.parent / "tiny_sweep" / "jax_cache")
  cmd = [sys.executable, "-m", "mhc_jax.cli", "sweep", str(f), "--out", str(out), "--parallel", "2"]
  rec: dict = {"out": str(out)}

  # 1. two jobs at once; once residual is done and hc is past a checkpoint, SIGKILL the whole
  #    process group: the sweep command, submitit's job controllers and the training processes
  def moment():
    if not _done(out, "mixer=residual"):
      return None
    return {n: _mid_run(out, n) for n in ("mixer=hc", "mixer=mhc") if _mid_run(out, n)} or None

  with open(root / "first.log", "w") as log:
    p = subprocess.Popen(
      cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
    )
    try:
      rec["at_kill"] = _wait_for(moment, 900, "residual done and a run past a checkpoint")
    finally:
      os.killpg(p.pid, signal.SIGKILL)
      p.wait()
  time.sleep(1.0)
  rec["first_out"] = (root / "first.log").read_text()
  rec["residual_digest"] = _digest(out / "runs" / "mixer=residual" / "metrics.jsonl")
  # 2. the same command again: trains what is left, each run from where it was
  t0 = time.time()
  r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
  rec["second"] = {
    "rc": r.returncode,
    "out": r.stdout,
    "err": r.stderr[-3000:],
    "s": time.time() - t0,
  }
  rec["residual_digest_after"] = _digest(out / "runs" / "mixer=residual" / "metrics.jsonl")
  rec["job_logs"] = "".join(
    p.read_text(errors="replace") for p in sorted((out / "submitit").rglob("*.out"))
  )
  return rec


@pytest.fixture(scope="session")
def killed_sweep(tmp_path_factory, tiny_sweep) -> dict:  # noqa: F811
  # tiny_sweep first: it fills the compilation cache both use, and it is the reference
  root = _shared_dir(tmp_path_factory) / "killed_sweep"
  root.mkdir(exist_ok=True)
  with open(root / "lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    done = root / "record.json"
    if not done.exists():
      done.write_text(json.dumps(_build_killed(root)))
    rec = json.loads(done.read_text())
  rec["out"] = Path(rec["out"])
  return rec


def _same_logs(a: Path, b: Path) -> None:
  ra, rb = logs.read_jsonl(a / "metrics.jsonl"), logs.read_jsonl(b / "metrics.jsonl")
  assert [r["step"] for r in ra] == list(range(TINY_STEPS))
  for x, y in zip(ra, rb):
    assert {k: v for k, v in x.items() if k not in TIMING} == {
      k: v for k, v in y.items() if k not in TIMING
    }


@pytest.mark.slow
def test_killed_local_sweep_trains_each_run_once(killed_sweep, tiny_sweep):  # noqa: F811
  out, second = killed_sweep["out"], killed_sweep["second"]
  assert second["rc"] == 0, second
  first = killed_sweep["first_out"]
  assert "sweep tinypar: 3 runs (0 done, 0 failed, 3 to run)" in first
  assert "as local jobs, up to 2 at once" in first and "[1/3] mixer=residual: starting" in first
  # the finished run is not trained again; the killed ones resume from their checkpoints
  assert "sweep tinypar: 3 runs (1 done, 0 failed, 2 to run)" in second["out"], second["out"]
  assert "mixer=residual" not in second["out"].split("| run |")[0]
  assert killed_sweep["residual_digest"] == killed_sweep["residual_digest_after"]
  for name, ckpts in killed_sweep["at_kill"].items():
    assert re.search(rf"{re.escape(name)}: resuming from step (\d+)", second["out"]), name
    step = int(re.search(rf"{re.escape(name)}: resuming from step (\d+)", second["out"]).group(1))
    assert step >= max(ckpts)
  # each run started from step 0 exactly once over both commands, and logged each step once
  starts = re.findall(r"(mixer=\w+): training from step (\d+)", killed_sweep["job_logs"])
  for name in ("mixer=residual", "mixer=hc", "mixer=mhc"):
    assert [s for n, s in starts if n == name].count("0") == 1, starts
    _same_logs(out / "runs" / name, tiny_sweep["out"] / "runs" / name)
  m = json.loads((out / "manifest.json").read_text())
  assert {i["status"] for i in m["runs"].values()} == {"done"}
  assert (out / "report" / "summary.md").exists()


# =========================================================================== requeue (SIGUSR2)
def _build_requeued(root: Path) -> dict:
  f = _tiny_file(root, "tinysub", ["mhc"])
  out = root / "sweep"
  env = sweep_env(root.parent / "tiny_sweep" / "jax_cache")
  cmd = [sys.executable, "-m", "mhc_jax.cli", "sweep", str(f), "--out", str(out), "--parallel", "1"]
  rec: dict = {"out": str(out)}
  with open(root / "sweep.log", "w") as log:
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
      ckpts = _wait_for(lambda: p.poll() is None and _mid_run(out, "mixer=mhc"), 600, "no ckpt")
      pid = json.loads((out / "runs" / "mixer=mhc" / ".lock").read_text())["pid"]
      os.kill(pid, signal.SIGUSR2)  # what submitit/SLURM send ahead of a time limit
      rec["preempted"] = {"pid": pid, "ckpts": ckpts}
      rec["rc"] = p.wait(timeout=900)
    finally:
      if p.poll() is None:
        p.kill()
  rec["log"] = (root / "sweep.log").read_text()
  rec["job_logs"] = "".join(
    q.read_text(errors="replace") for q in sorted((out / "submitit").rglob("*.out"))
  )
  return rec


@pytest.fixture(scope="session")
def requeued_sweep(tmp_path_factory, tiny_sweep) -> dict:  # noqa: F811
  root = _shared_dir(tmp_path_factory) / "requeued_sweep"
  root.mkdir(exist_ok=True)
  with open(root / "lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    done = root / "record.json"
    if not done.exists():
      done.write_text(json.dumps(_build_requeued(root)))
    rec = json.loads(done.read_text())
  rec["out"] = Path(rec["out"])
  return rec


@pytest.mark.slow
def test_a_job_sent_sigusr2_is_requeued_and_resumes(requeued_sweep, tiny_sweep):  # noqa: F811
  out = requeued_sweep["out"]
  assert requeued_sweep["rc"] == 0, requeued_sweep["log"][-3000:]
  assert "Requeued job" in requeued_sweep["job_logs"], requeued_sweep["job_logs"][-3000:]
  starts = [
    int(s) for s in re.findall(r"mixer=mhc: training from step (\d+)", requeued_sweep["job_logs"])
  ]
  assert (
    starts[0] == 0 and len(starts) == 2 and starts[1] >= max(requeued_sweep["preempted"]["ckpts"])
  )
  _same_logs(out / "runs" / "mixer=mhc", tiny_sweep["out"] / "runs" / "mixer=mhc")
  assert json.loads((out / "manifest.json").read_text())["runs"]["mixer=mhc"]["status"] == "done"


# =========================================================================== a planted crash
# A job killed mid-run (as the OOM killer would), planted from outside the production code: a
# sitecustomize.py on the jobs' PYTHONPATH wraps train.loop.host_batch so that the hc run's
# process SIGKILLs itself when it asks for training batch CRASH_STEP.
CRASH_STEP = 15
PLANT = """
import os
if os.environ.get("PLANT_CRASH_MIXER"):
  import signal
  from mhc_jax.train import loop

  _host_batch = loop.host_batch

  def host_batch(source, cfg, step, split="train"):
    if split == "train" and step == {step} and cfg.model.mixer == os.environ["PLANT_CRASH_MIXER"]:
      os.kill(os.getpid(), signal.SIGKILL)
    return _host_batch(source, cfg, step, split)

  loop.host_batch = host_batch
"""


def _build_crashed(root: Path) -> dict:
  f = _tiny_file(root, "tinycrash", ["residual", "hc"])
  out = root / "sweep"
  plant = root / "plant"
  plant.mkdir(exist_ok=True)
  (plant / "sitecustomize.py").write_text(PLANT.format(step=CRASH_STEP))
  pythonpath = os.pathsep.join(filter(None, [str(plant), os.environ.get("PYTHONPATH")]))
  cache = root.parent / "tiny_sweep" / "jax_cache"
  planted = sweep_env(cache, PYTHONPATH=pythonpath, PLANT_CRASH_MIXER="hc")
  cmd = [sys.executable, "-m", "mhc_jax.cli", "sweep", str(f), "--out", str(out), "--parallel", "2"]
  rec: dict = {"out": str(out)}

  def run(env):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    return {"rc": r.returncode, "out": r.stdout, "err": r.stderr[-3000:]}

  rec["first"] = run(planted)  # hc's job dies at step CRASH_STEP; residual trains on
  rec["hc_summary"] = json.loads((out / "runs" / "mixer=hc" / "summary.json").read_text())
  rec["hc_steps"] = _steps(out / "runs" / "mixer=hc" / "metrics.jsonl")
  rec["residual_digest"] = _digest(out / "runs" / "mixer=residual" / "metrics.jsonl")
  rec["again"] = run(planted)  # a failed run is kept as it is: nothing trains
  (out / "runs" / "mixer=hc").rename(root / "failed_hc")  # to retry a failed run, remove it
  rec["retry"] = run(sweep_env(cache))  # no plant: hc trains to the end
  rec["residual_digest_after"] = _digest(out / "runs" / "mixer=residual" / "metrics.jsonl")
  return rec


@pytest.fixture(scope="session")
def crashed_sweep(tmp_path_factory, tiny_sweep) -> dict:  # noqa: F811
  root = _shared_dir(tmp_path_factory) / "crashed_sweep"
  root.mkdir(exist_ok=True)
  with open(root / "lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    done = root / "record.json"
    if not done.exists():
      done.write_text(json.dumps(_build_crashed(root)))
    rec = json.loads(done.read_text())
  rec["out"] = Path(rec["out"])
  return rec


@pytest.mark.slow
def test_a_crashed_job_fails_only_its_run(crashed_sweep, tiny_sweep):  # noqa: F811
  first, out = crashed_sweep["first"], crashed_sweep["out"]
  # the sweep goes on, exits 1 (some run failed), and says which run failed and why
  assert first["rc"] == 1, first
  assert crashed_sweep["hc_summary"]["status"] == "failed"
  msg = crashed_sweep["hc_summary"]["message"]
  assert "died without a result (its process was killed or exited" in msg, msg
  assert max(crashed_sweep["hc_steps"]) < CRASH_STEP  # it died where it was planted
  # the other run trained to the end, exactly as in the sequential reference
  _same_logs(out / "runs" / "mixer=residual", tiny_sweep["out"] / "runs" / "mixer=residual")
  # a re-run keeps both as they are (nothing retrains); after removing the failed run, a
  # re-run trains only it, and the sweep is done
  again = crashed_sweep["again"]
  assert again["rc"] == 1 and "all 2 runs are finished (1 done, 1 failed)" in again["out"], again
  retry = crashed_sweep["retry"]
  assert retry["rc"] == 0 and "(1 done, 0 failed, 1 to run)" in retry["out"], retry
  assert crashed_sweep["residual_digest"] == crashed_sweep["residual_digest_after"]
  _same_logs(out / "runs" / "mixer=hc", tiny_sweep["out"] / "runs" / "mixer=hc")
  m = json.loads((out / "manifest.json").read_text())
  assert {i["status"] for i in m["runs"].values()} == {"done"}
