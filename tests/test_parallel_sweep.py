"""Parallel sweeps (mhc_jax.sweep.executor / worker): bad input, device slots, and -- in worker
processes -- logs identical to a sequential sweep's, a planted crash that fails alone, a killed
worker resumed by the next invocation, and a sweep through submitit's local executor whose job
is preempted (SIGUSR2), requeued and resumed.

The slow tests share two session fixtures built once (xdist workers share them through a file
lock): ``parallel_sweep`` (4 runs, ``--parallel 2``, killed mid-run then re-run) and
``submitit_sweep`` (2 runs through submitit-local, one job preempted). Their runs are the
runs of ``test_sweep.tiny_sweep`` (same configs), which is the sequential reference.
"""

from __future__ import annotations

import fcntl
import json
import os
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
  _shared_dir,
  _steps,
  sweep_env,
  tiny_sweep,
)

from mhc_jax import cli, logs
from mhc_jax.sweep import executor as ex, grid, options as how
from mhc_jax.train.config import ConfigError

TIMING = ("tokens_per_s", "step_time_s")
PLANT = "mixer=mhc_lite@2:abort"


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
      {"executor": {"kind": "process", "timeout_min": 5}},
      "executor.timeout_min: the process executor",
    ),
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
  sw = grid.load_sweep(
    _tiny_file(tmp_path, "t", ["residual", "mhc"], set={"model.mixer_options": {}, "mesh.data": 4})
  )
  ex.check_runs(sw, 4)
  with pytest.raises(
    ConfigError,
    match=r"^run mixer=residual: mesh.*each of the parallel workers "
    r"has 2 device",
  ):
    ex.check_runs(sw, 2)


def test_sweep_file_parallel_setting_is_read(tmp_path):
  sw = grid.load_sweep(
    _tiny_file(
      tmp_path,
      "t",
      ["residual"],
      parallel=3,
      executor={"kind": "submitit-local", "timeout_min": 30},
    )
  )
  assert sw.options == {"parallel": 3, "executor": {"kind": "submitit-local", "timeout_min": 30}}
  assert how.executor_options(sw.options["executor"], None) == (
    "submitit-local",
    {"timeout_min": 30},
  )
  assert how.executor_options(sw.options["executor"], "process") == ("process", {})  # flag wins
  assert grid.load_sweep(_tiny_file(tmp_path, "u", ["residual"])).options == {}


# =========================================================================== slots
def test_gpu_slots_split_the_visible_gpus():
  slots = ex.make_slots(2, "gpu", ["0", "1", "2", "3"])
  assert [s.env["CUDA_VISIBLE_DEVICES"] for s in slots] == ["0,1", "2,3"]
  assert [s.n_devices for s in slots] == [2, 2]
  assert [s.env["CUDA_VISIBLE_DEVICES"] for s in ex.make_slots(3, "gpu", list("0123"))] == [
    "0",
    "1",
    "2",
  ]
  with pytest.raises(ConfigError, match="--parallel: 3 runs at once need at least 3 GPUs"):
    ex.make_slots(3, "gpu", ["0", "1"])
  # detection reads CUDA_VISIBLE_DEVICES without starting CUDA
  assert ex.detect_devices({"CUDA_VISIBLE_DEVICES": "4,6", "JAX_PLATFORMS": ""}) == (
    "gpu",
    ["4", "6"],
  )
  assert ex.detect_devices({"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "0"})[0] == "cpu"


def test_tpu_slots_get_their_own_chips_and_ports():
  slots = ex.make_slots(4, "tpu", ["0", "1", "2", "3"])
  assert [s.env["TPU_VISIBLE_CHIPS"] for s in slots] == ["0", "1", "2", "3"]
  assert {s.env["TPU_CHIPS_PER_PROCESS_BOUNDS"] for s in slots} == {"1,1,1"}
  assert len({s.env["TPU_MESH_CONTROLLER_PORT"] for s in slots}) == 4
  two = ex.make_slots(2, "tpu", ["0", "1", "2", "3"])
  assert [s.env["TPU_VISIBLE_CHIPS"] for s in two] == ["0,1", "2,3"]
  assert two[0].env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,2,1"


def test_cpu_slots_keep_the_device_count_and_pin_on_request():
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  slots = ex.make_slots(2, "cpu", ["0", "1"], env)
  assert [s.n_devices for s in slots] == [8, 8]  # what a sequential run's mesh spans
  assert [s.cpus for s in slots] == [None, None]  # same thread pool as a sequential run
  pin = {**env, "MHC_SWEEP_PIN_CPUS": "1"}
  assert [s.cpus for s in ex.make_slots(2, "cpu", ["0", "1"], pin)] == [[0], [1]]
  assert [s.cpus for s in ex.make_slots(3, "cpu", ["0", "1"], pin)] == [[0], [1], [0]]
  assert [s.cpus for s in ex.make_slots(2, "cpu", list("0123"), {"MHC_SWEEP_PIN_CPUS": "1"})] == [
    [0, 1],
    [2, 3],
  ]
  assert ex.make_slots(1, "cpu", ["0"], {})[0].n_devices == 1


# =========================================================================== real workers
def _wait_for(pred, timeout: float, what: str):
  t0 = time.time()
  while time.time() - t0 < timeout:
    v = pred()
    if v:
      return v
    time.sleep(0.1)
  raise TimeoutError(what)


def _manifest(out: Path) -> dict:
  try:
    return json.loads((out / "manifest.json").read_text())
  except (OSError, ValueError):
    return {"runs": {}}


def _mid_run(out: Path, name: str):
  """The run's worker pid once it has a checkpoint and has logged past it, else None."""
  info = _manifest(out)["runs"].get(name, {})
  rdir = out / "runs" / name
  try:
    ck = {int(c.name) for c in (rdir / "checkpoints").iterdir() if c.name.isdigit()}
    steps = _steps(rdir / "metrics.jsonl")
  except (OSError, ValueError):
    return None
  if (
    info.get("status") == "running" and info.get("owner") and ck and steps and max(steps) > min(ck)
  ):
    return info["owner"]["pid"], sorted(ck)
  return None


def _env(root: Path, **extra) -> dict:
  return sweep_env(root.parent / "tiny_sweep" / "jax_cache", **extra)  # as the reference's


def _build_parallel(root: Path) -> dict:
  f = _tiny_file(root, "tinypar", ["residual", "hc", "mhc", "mhc_lite"])
  out = root / "sweep"
  env = _env(root, **{"MHC_SWEEP_PLANT": PLANT})
  cmd = [sys.executable, "-m", "mhc_jax.cli", "sweep", str(f), "--out", str(out), "--parallel", "2"]
  rec: dict = {"out": str(out)}

  # 1. two workers at once; when mixer=residual is past a checkpoint (hc, slower, still
  #    running), the sweep command and residual's worker are SIGKILLed: hc's worker lives on
  def victim_mid_run():
    hit = p.poll() is None and _mid_run(out, "mixer=residual")
    return hit if hit and _manifest(out)["runs"]["mixer=hc"]["status"] == "running" else None

  with open(root / "first.log", "w") as log:
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
      pid, ckpts = _wait_for(
        victim_mid_run, 600, "mixer=residual never got past a checkpoint while mixer=hc ran"
      )
    finally:
      p.kill()
      p.wait()
    os.kill(pid, signal.SIGKILL)
    m = _manifest(out)
    rec["at_kill"] = {
      "status": {n: i["status"] for n, i in m["runs"].items()},
      "ckpts": ckpts,
      "victim_pid": pid,
    }
  rec["first_out"] = (root / "first.log").read_text()
  # 2. the orphaned worker finishes its run and records it with nobody watching
  _wait_for(
    lambda: _manifest(out)["runs"]["mixer=hc"]["status"] in ("done", "failed"),
    600,
    "the orphaned hc worker did not finish",
  )
  rec["after_orphan"] = _manifest(out)["runs"]["mixer=hc"]
  # 3. the next invocation: resumes hc, trains mhc; mhc_lite crashes (planted abort)
  t0 = time.time()
  r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
  rec["second"] = {
    "rc": r.returncode,
    "out": r.stdout,
    "err": r.stderr[-3000:],
    "s": time.time() - t0,
  }
  return rec


def _once(tmp_path_factory, name: str, build) -> dict:
  root = _shared_dir(tmp_path_factory) / name
  root.mkdir(exist_ok=True)
  with open(root / "lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    done = root / "record.json"
    if not done.exists():
      done.write_text(json.dumps(build(root)))
    rec = json.loads(done.read_text())
  rec["out"] = Path(rec["out"])
  return rec


@pytest.fixture(scope="session")
def parallel_sweep(tmp_path_factory, tiny_sweep) -> dict:  # noqa: F811
  # tiny_sweep first: it fills the compilation cache both use, and it is the reference
  return _once(tmp_path_factory, "parallel_sweep", _build_parallel)


def _same_logs(a: Path, b: Path) -> None:
  ra, rb = logs.read_jsonl(a / "metrics.jsonl"), logs.read_jsonl(b / "metrics.jsonl")
  assert [r["step"] for r in ra] == list(range(TINY_STEPS))
  assert [r["loss"] for r in ra] == [r["loss"] for r in rb]
  for x, y in zip(ra, rb):
    assert {k: v for k, v in x.items() if k not in TIMING} == {
      k: v for k, v in y.items() if k not in TIMING
    }


@pytest.mark.slow
def test_parallel_logs_identical_to_sequential(parallel_sweep, tiny_sweep):  # noqa: F811
  for name in ("mixer=residual", "mixer=hc", "mixer=mhc"):
    _same_logs(parallel_sweep["out"] / "runs" / name, tiny_sweep["out"] / "runs" / name)
    s = json.loads((parallel_sweep["out"] / "runs" / name / "summary.json").read_text())
    assert s["status"] == "done" and s["steps"] == TINY_STEPS


@pytest.mark.slow
def test_planted_crash_fails_alone_and_the_report_marks_it(parallel_sweep):
  second, out = parallel_sweep["second"], parallel_sweep["out"]
  assert second["rc"] == 1, second
  m = _manifest(out)
  assert {n: i["status"] for n, i in m["runs"].items()} == {
    "mixer=residual": "done",
    "mixer=hc": "done",
    "mixer=mhc": "done",
    "mixer=mhc_lite": "failed",
  }
  err = m["runs"]["mixer=mhc_lite"]["error"]
  assert "killed by SIGABRT" in err and "planted crash (abort) at step 2" in err, err
  assert "1 run(s) failed: mixer=mhc_lite" in second["out"]
  assert "| mixer=mhc_lite | mhc_lite |" in second["out"] and "| failed |" in second["out"]
  summary = (out / "report" / "summary.md").read_text()
  row = next(line for line in summary.splitlines() if line.startswith("| mixer=mhc_lite "))
  assert "| failed |" in row
  html = (out / "report" / "index.html").read_text()
  assert 'class="status-failed"' in html


@pytest.mark.slow
def test_killed_worker_is_resumed_by_the_next_invocation(parallel_sweep):
  at_kill, out = parallel_sweep["at_kill"], parallel_sweep["out"]
  assert at_kill["status"]["mixer=residual"] == "running"
  assert at_kill["status"]["mixer=hc"] == "running"
  second = parallel_sweep["second"]["out"]
  assert f"mixer=residual: resuming from step {max(at_kill['ckpts'])}" in second, second
  assert "mixer=residual: starting" not in second
  res = _manifest(out)["runs"]["mixer=residual"]
  assert res["attempts"] == 2 and f":{at_kill['victim_pid']}" in res["taken_over"]
  assert _steps(out / "runs" / "mixer=residual" / "metrics.jsonl") == list(range(TINY_STEPS))
  # hc was finished by its orphaned worker, recorded with nobody watching, not trained again
  assert parallel_sweep["after_orphan"]["status"] == "done"
  assert _manifest(out)["runs"]["mixer=hc"]["attempts"] == 1
  assert "mixer=hc:" not in second


@pytest.mark.slow
def test_progress_lines_while_it_runs(parallel_sweep):
  first = parallel_sweep["first_out"]
  assert "sweep tinypar: 4 runs (0 done, 0 failed, 4 to run)" in first
  assert "with process workers, up to 2 at once" in first
  assert "sweep tinypar: 0/4 done, 2 running, 0 failed, 2 pending; ETA" in first
  assert "[1/4] mixer=residual: starting (worker" in first
  second = parallel_sweep["second"]["out"]
  assert "sweep tinypar: 3/4 done, 0 running, 1 failed, 0 pending; ETA 0s" in second


# =========================================================================== submitit
def _build_submitit(root: Path) -> dict:
  f = _tiny_file(root, "tinysub", ["residual", "mhc"])
  out = root / "sweep"
  cmd = [
    sys.executable,
    "-m",
    "mhc_jax.cli",
    "sweep",
    str(f),
    "--out",
    str(out),
    "--parallel",
    "2",
    "--executor",
    "submitit-local",
  ]
  rec: dict = {"out": str(out)}
  with open(root / "sweep.log", "w") as log:
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(root), cwd=REPO)
    try:
      pid, ckpts = _wait_for(
        lambda: p.poll() is None and _mid_run(out, "mixer=mhc"),
        600,
        "mixer=mhc never got past a checkpoint",
      )
      os.kill(pid, signal.SIGUSR2)  # what submitit/SLURM send ahead of a preemption
      rec["preempted"] = {"pid": pid, "ckpts": ckpts}
      rec["rc"] = p.wait(timeout=900)
    finally:
      if p.poll() is None:
        p.kill()
  rec["log"] = (root / "sweep.log").read_text()
  return rec


@pytest.fixture(scope="session")
def submitit_sweep(tmp_path_factory, tiny_sweep) -> dict:  # noqa: F811
  pytest.importorskip("submitit")
  return _once(tmp_path_factory, "submitit_sweep", _build_submitit)


@pytest.mark.slow
def test_submitit_local_sweep_requeues_and_resumes(submitit_sweep, tiny_sweep):  # noqa: F811
  out = submitit_sweep["out"]
  assert submitit_sweep["rc"] == 0, submitit_sweep["log"][-3000:]
  m = _manifest(out)
  assert {n: i["status"] for n, i in m["runs"].items()} == {
    "mixer=residual": "done",
    "mixer=mhc": "done",
  }
  # the preempted job saved a checkpoint, gave its run back, was requeued and resumed it
  mhc = m["runs"]["mixer=mhc"]
  assert mhc["attempts"] == 2 and mhc["resumed_from"] >= max(submitit_sweep["preempted"]["ckpts"])
  assert f"mixer=mhc: resuming from step {mhc['resumed_from']}" in submitit_sweep["log"]
  assert m["runs"]["mixer=residual"]["attempts"] == 1
  for name in ("mixer=residual", "mixer=mhc"):  # logs complete, each step once, as sequential
    _same_logs(out / "runs" / name, tiny_sweep["out"] / "runs" / name)
  job_logs = "".join(p.read_text(errors="replace") for p in (out / "submitit").rglob("*.out"))
  assert "Requeued job" in job_logs or "requeue" in job_logs.lower()
  assert (out / "report" / "index.html").exists()
  summary = (out / "report" / "summary.md").read_text()
  rows = [line for line in summary.splitlines() if line.startswith("| mixer=")]
  assert len(rows) == 2 and all("| done |" in row for row in rows), rows
