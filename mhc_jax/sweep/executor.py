"""Parallel sweeps: up to K units (a run, or a population) at once, each in its own process.

``mhc-jax sweep FILE --parallel K [--executor process|submitit-local|slurm]`` (or ``parallel:``
and ``executor:`` in the sweep file; flags win). The parent process never trains and never
touches an accelerator: it checks every run's config (the mesh against one slot's devices),
then starts workers (:mod:`mhc_jax.sweep.worker`), watches the manifest, and shows the sweep's
progress. A worker claims its runs in the manifest (:mod:`mhc_jax.sweep.manifest`), trains
them and records the results itself, so a worker that crashes, runs out of memory or goes NaN
takes no other run down, and one that outlives the parent still records its result.

Executors:

- ``process`` (default): a subprocess per unit on this host, each pinned to its own slice of
  the devices: GPUs through ``CUDA_VISIBLE_DEVICES`` (each slot gets ``GPUs // K`` of them),
  TPU chips through ``TPU_VISIBLE_CHIPS`` and the per-process chip bounds. On the CPU every
  worker gets the parent's simulated device count (``XLA_FLAGS``) and, by default, all the
  cores, left to the OS scheduler: XLA sizes its intra-op thread pool to the cores a process
  may use, and a smaller pool changes the rounding of multi-threaded ops, so pinned workers
  would not reproduce a sequential sweep's numbers bit for bit (measured: 3 of 4 runs
  differed). ``MHC_SWEEP_PIN_CPUS=1`` pins slot i to its own ``cores // K`` cores instead. Workers start in their own session: Ctrl-C or SIGTERM reaches the
  parent, which passes SIGTERM on (every worker saves a checkpoint and gives its runs back as
  pending) and exits 143.
- ``submitit-local``: the same through submitit's local executor (a job per unit; used by the
  tests as the stand-in for a cluster).
- ``slurm``: a SLURM job per unit through submitit (``#SBATCH --requeue``). submitit sends
  SIGUSR2 ahead of the time limit; SIGUSR2 or SIGTERM (preemption) makes the worker save a
  checkpoint, give its runs back, and requeue the job, whose next life resumes from the
  checkpoint. Without ``--parallel`` every unit is submitted at once and SLURM schedules them;
  with it at most K jobs are in the queue at a time. The command stays to show progress and
  write the report; interrupting it leaves the jobs running (run it again to watch them).

The sweep file's ``executor:`` mapping is passed to submitit's ``update_parameters`` (e.g.
``slurm_partition``, ``timeout_min``, ``gpus_per_node``, ``cpus_per_task``, ``mem_gb``,
``slurm_additional_parameters``); ``kind:`` in it names the executor.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from mhc_jax.sweep import manifest as mf
from mhc_jax.sweep.options import EXECUTORS, import_submitit
from mhc_jax.sweep.worker import EXIT_NOT_CLAIMED, EXIT_PREEMPTED
from mhc_jax.train.config import ConfigError

__all__ = [
  "EXECUTORS",
  "Slot",
  "detect_devices",
  "make_slots",
  "check_runs",
  "run_parallel",
  "SweepJob",
]

EXIT_FAILED = 1
_DIST_ENV = ("MHC_COORDINATOR", "MHC_NUM_PROCESSES", "MHC_PROCESS_ID")
_TPU_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}


# ------------------------------------------------------------------------------------------
# Devices and slots.


def _visible_gpus(env) -> list[str]:
  if "CUDA_VISIBLE_DEVICES" in env:
    return [
      d.strip() for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip() and d.strip() != "-1"
    ]
  smi = shutil.which("nvidia-smi")
  if not smi:
    return []
  try:
    out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
  except (OSError, subprocess.SubprocessError):
    return []
  return [str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU "))]


def _tpu_chips() -> list[str]:
  import glob

  accel = sorted(glob.glob("/dev/accel[0-9]*"))
  if accel:
    return [str(i) for i in range(len(accel))]
  vfio = [p for p in glob.glob("/dev/vfio/[0-9]*")]
  return [str(i) for i in range(len(vfio))]


def detect_devices(env=None) -> tuple[str, list[str]]:
  """(platform, device ids) of this host, without starting an accelerator runtime:
  ``gpu`` (CUDA_VISIBLE_DEVICES, else nvidia-smi), ``tpu`` (/dev/accel*, /dev/vfio), else
  ``cpu`` with the cores this process may use."""
  env = os.environ if env is None else env
  first = env.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
  if first in ("", "cuda", "gpu"):
    gpus = _visible_gpus(env)
    if gpus:
      return "gpu", gpus
  if first in ("", "tpu"):
    chips = _tpu_chips()
    if chips:
      return "tpu", chips
  cores = (
    sorted(os.sched_getaffinity(0))
    if hasattr(os, "sched_getaffinity")
    else list(range(os.cpu_count() or 1))
  )
  return "cpu", [str(c) for c in cores]


def cpu_device_count(env=None) -> int:
  """The simulated CPU device count XLA_FLAGS asks for (1 without the flag)."""
  env = os.environ if env is None else env
  m = re.search(r"--xla_force_host_platform_device_count=(\d+)", env.get("XLA_FLAGS", ""))
  return int(m.group(1)) if m else 1


@dataclasses.dataclass
class Slot:
  index: int
  platform: str
  devices: list  # device ids (GPU/TPU) or cores (CPU)
  env: dict  # variables to set for the worker
  cpus: list | None  # cores to pin to (CPU)
  n_devices: int  # what the run's mesh spans


def make_slots(
  k: int, platform: str | None = None, devices: list | None = None, env=None
) -> list[Slot]:
  """K slots over this host's devices (see the module docstring); ConfigError when there are
  fewer accelerators than K."""
  env = os.environ if env is None else env
  if platform is None:
    platform, devices = detect_devices(env)
  devices = list(devices or [])
  slots = []
  if platform in ("gpu", "tpu"):
    per = len(devices) // k
    if per == 0:
      raise ConfigError(
        f"--parallel: {k} runs at once need at least {k} {platform.upper()}s "
        f"(one each); this host has {len(devices)}"
      )
    if platform == "tpu" and per not in _TPU_BOUNDS:
      per = max(p for p in _TPU_BOUNDS if p <= per)
    for i in range(k):
      ids = devices[i * per : (i + 1) * per]
      if platform == "gpu":
        e = {"CUDA_VISIBLE_DEVICES": ",".join(ids)}
      else:
        port = 8476 + i
        e = {
          "TPU_VISIBLE_CHIPS": ",".join(ids),
          "TPU_VISIBLE_DEVICES": ",".join(ids),
          "TPU_CHIPS_PER_PROCESS_BOUNDS": _TPU_BOUNDS[per],
          "TPU_PROCESS_BOUNDS": "1,1,1",
          "TPU_PROCESS_PORT": str(port),
          "TPU_PROCESS_ADDRESSES": f"localhost:{port}",
          "TPU_MESH_CONTROLLER_ADDRESS": f"localhost:{port}",
          "TPU_MESH_CONTROLLER_PORT": str(port),
          "CLOUD_TPU_TASK_ID": "0",
        }
      slots.append(Slot(i, platform, ids, e, None, per))
    return slots
  cores = [int(c) for c in devices] or [0]
  per = max(1, len(cores) // k)
  n_dev = cpu_device_count(env)
  pin = env.get("MHC_SWEEP_PIN_CPUS", "0") == "1"
  for i in range(k):
    start = (i * per) % len(cores)
    mine = (cores + cores)[start : start + per]
    slots.append(Slot(i, "cpu", [str(c) for c in mine], {}, mine if pin else None, n_dev))
  return slots


def check_runs(sweep, n_devices: int) -> None:
  """What ``train.loop.prepare`` checks, for a worker with `n_devices` devices, without
  touching any device here: data source options, vocabulary, the mesh. ConfigError naming
  the run (and the axis at fault)."""
  from mhc_jax import data
  from mhc_jax.train.config import validate_mesh, with_data_vocab

  for r in sweep.runs:
    cfg = r.cfg
    try:
      try:
        source = data.make_source(
          cfg.data.task, seq_len=cfg.data.seq_len, seed=cfg.train.seed, **cfg.data.options
        )
      except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"data.options: {e}") from None
      cfg = with_data_vocab(cfg, source.vocab_size)
      if cfg.model.vocab < source.vocab_size:
        raise ConfigError(
          f"model.vocab: {cfg.model.vocab} is smaller than the data's vocabulary "
          f"({source.vocab_size})"
        )
      if cfg.data.target == "posterior" and not source.has_posterior:
        raise ConfigError("data.target: 'posterior' needs a task with an exact posterior")
      validate_mesh(cfg.mesh, n_devices, cfg.data.batch_size)
    except ConfigError as e:
      key = str(e).split(":", 1)[0].strip()
      axis = next((a for a in r.overrides if key == a or key.startswith(a + ".")), None)
      where = (
        f"axes.{axis}: value {r.overrides[axis]!r} (run {r.name})" if axis else f"run {r.name}"
      )
      raise ConfigError(
        f"{where}: {e} (each of the parallel workers has {n_devices} device(s))"
      ) from None


# ------------------------------------------------------------------------------------------
# Launchers: start a unit's worker, tell when it has ended.


def _unit_spec(sweep, names: list[str], runs_info: dict, token: str, slot: Slot | None) -> dict:
  from mhc_jax.train.config import to_dict

  runs = {}
  for n in names:
    d = to_dict(sweep.run(n).cfg)
    d.pop("dist", None)  # a worker is one process
    runs[n] = {"config": d, "dir": runs_info[n]["dir"]}
  spec = {"token": token, "runs": runs}
  if slot is not None:
    spec["cpus"] = slot.cpus
    spec["env"] = slot.env
  return spec


@dataclasses.dataclass
class Started:
  names: list
  slot: int
  token: str
  log: Path | None
  job: Any = None
  proc: Any = None
  job_id: str | None = None

  def owns(self, owner: dict | None) -> bool:
    if not owner:
      return False
    return owner.get("token") == self.token or (
      self.job_id is not None and owner.get("job") == self.job_id
    )


class ProcessLauncher:
  kind = "process"
  detach = False

  def __init__(self, sweep_dir: Path):
    self.dir = sweep_dir
    (sweep_dir / "workers").mkdir(parents=True, exist_ok=True)

  def start(self, spec: dict, slot: Slot, names: list[str]) -> Started:
    token = spec["token"]
    spec_path = self.dir / "workers" / f"{token}.json"
    spec_path.write_text(json.dumps(spec, indent=1, default=str))
    log = self.dir / "workers" / f"{token}.log"
    env = dict(os.environ)
    for k in _DIST_ENV:
      env.pop(k, None)
    env.update(slot.env)
    env["PYTHONUNBUFFERED"] = "1"
    with open(log, "ab") as out:
      proc = subprocess.Popen(
        [sys.executable, "-m", "mhc_jax.sweep.worker", str(self.dir), str(spec_path)],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
      )
    return Started(names, slot.index, token, log, proc=proc)

  def poll(self, s: Started) -> tuple[int, str] | None:
    rc = s.proc.poll()
    if rc is None:
      return None
    return rc, _describe_rc(rc)

  def stop(self, s: Started) -> None:
    if s.proc.poll() is None:
      with _suppress():
        s.proc.send_signal(signal.SIGTERM)


class _suppress:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return exc[0] is not None and issubclass(exc[0], (OSError, ProcessLookupError))


def _describe_rc(rc: int) -> str:
  if rc < 0:
    try:
      name = signal.Signals(-rc).name
    except ValueError:
      name = f"signal {-rc}"
    hint = " (out of memory?)" if -rc == signal.SIGKILL else ""
    return f"killed by {name}{hint}"
  return f"exit code {rc}"


def _tail(path: Path | None, n: int = 3) -> str:
  if path is None:
    return ""
  try:
    lines = [l for l in path.read_text(errors="replace").splitlines() if l.strip()]
  except OSError:
    return ""
  return " | ".join(l.strip()[:300] for l in lines[-n:])


class SweepJob:
  """The callable a submitit job runs: one unit's worker (picklable; imports nothing heavy).

  ``checkpoint()`` is submitit's requeue hook: the same job again, which resumes from the
  run's checkpoint. SIGUSR2 (submitit's signal before the time limit) is turned into the
  SIGTERM the training loop saves a checkpoint on; after that the job asks submitit to requeue
  it (SLURM: ``scontrol requeue``; the local executor: exit code 144)."""

  def __init__(self, sweep_dir: str, spec: dict):
    self.sweep_dir, self.spec = str(sweep_dir), spec

  def __call__(self) -> int:
    from mhc_jax.sweep import worker

    submitit_usr2 = signal.getsignal(signal.SIGUSR2)
    requeue = {"asked": False}

    def on_usr2(signum, frame):
      requeue["asked"] = True
      os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGUSR2, on_usr2)
    spec = dict(self.spec)
    spec["token"] = uuid.uuid4().hex[:12]  # every life of the job is its own owner
    for k in _DIST_ENV:
      os.environ.pop(k, None)
    rc = worker.run_unit(self.sweep_dir, spec)
    if rc == EXIT_PREEMPTED and callable(submitit_usr2):
      signal.signal(signal.SIGUSR2, submitit_usr2)
      submitit_usr2(signal.SIGUSR2, None)  # checkpoint() + requeue; does not return
    return rc

  def checkpoint(self, *args, **kwargs):
    import submitit

    return submitit.helpers.DelayedSubmission(self, *args, **kwargs)


class SubmititLauncher:
  def __init__(self, sweep_dir: Path, kind: str, params: dict):
    submitit = import_submitit()
    self.dir, self.kind = sweep_dir, kind
    folder = sweep_dir / "submitit" / "%j"
    params = dict(params)
    if kind == "submitit-local":
      self.executor = submitit.LocalExecutor(folder=folder, max_num_timeout=100)
      params.setdefault("timeout_min", 7 * 24 * 60)
    else:
      self.executor = submitit.AutoExecutor(
        folder=folder, cluster="slurm", slurm_max_num_timeout=100
      )
      extra = dict(params.pop("slurm_additional_parameters", None) or {})
      extra.setdefault("requeue", True)
      params["slurm_additional_parameters"] = extra
      params.setdefault("name", f"mhc-sweep-{sweep_dir.name}")
    self.params = params
    self.detach = kind == "slurm"

  def start(self, spec: dict, slot: Slot, names: list[str]) -> Started:
    params = dict(self.params)
    if self.kind == "submitit-local" and slot.platform == "gpu":
      params.setdefault("visible_gpus", [int(g) for g in slot.devices if g.isdigit()])
      params.setdefault("gpus_per_node", len(slot.devices))
    self.executor.update_parameters(**params)
    job = self.executor.submit(SweepJob(str(self.dir), spec))
    jid = (
      f"local:{os.uname().nodename}:{job.job_id}"
      if self.kind == "submitit-local"
      else f"slurm:{job.job_id}"
    )
    log = Path(str(job.paths.stdout))
    return Started(names, slot.index, spec["token"], log, job=job, job_id=jid)

  def poll(self, s: Started) -> tuple[int, str] | None:
    if not s.job.done():
      return None
    try:
      rc = s.job.result()
      return (int(rc) if isinstance(rc, int) else 0), f"job {s.job.job_id} ended"
    except Exception as e:  # noqa: BLE001 - the job crashed or was killed
      text = str(e).strip().splitlines()
      return -1, f"job {s.job.job_id} failed: {text[-1] if text else type(e).__name__}"

  def stop(self, s: Started) -> None:
    if self.detach:
      return
    with _suppress():
      s.job.cancel(check=False)


# ------------------------------------------------------------------------------------------
# The scheduler.


def _install_stop_handlers(stop: dict):
  old = {}

  def handler(signum, frame):
    stop["count"] = stop.get("count", 0) + 1
    stop["signal"] = signum

  for sig in (signal.SIGTERM, signal.SIGINT):
    try:
      old[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread
      pass
  return old


def run_parallel(
  sweep,
  out_dir: Path,
  units: list[list[str]],
  k: int | None,
  kind: str = "process",
  params: dict | None = None,
  *,
  progress: bool = True,
  poll_s: float = 0.5,
) -> int:
  """Train `units` of `sweep` (lists of run names already in the manifest, one per worker job:
  a run or a population, ``grid.population_groups``) with up to `k` workers at once; returns 0,
  EXIT_FAILED when some run of the sweep failed, or 143 when stopped."""
  from mhc_jax.sweep.progress import SweepProgress

  out_dir = Path(out_dir)
  manifest = mf.Manifest(out_dir)
  names = [n for u in units for n in u]
  if k is None:
    k = len(units)
  k = max(1, min(k, len(units)))
  slots = (
    make_slots(k) if kind != "slurm" else [Slot(i, "cluster", [], {}, None, 0) for i in range(k)]
  )
  launcher = (
    ProcessLauncher(out_dir) if kind == "process" else SubmititLauncher(out_dir, kind, params or {})
  )
  me = mf.Worker.current()
  bar = SweepProgress(
    sweep.name, out_dir, {r.name: r.cfg.train.steps for r in sweep.runs}, k, enabled=progress
  )
  order = {n: i + 1 for i, n in enumerate(names)}
  seen: dict = {}

  def report_changes(m):
    for n in names:
      info = m["runs"].get(n, {})
      key = (info.get("status"), info.get("attempts"), info.get("resumed_from"))
      if seen.get(n) == key:
        continue
      seen[n] = key
      status = info.get("status")
      head = f"[{order[n]}/{len(names)}] {n}"
      if status == "running" and info.get("resumed_from") is not None:
        step = info["resumed_from"]
        where = info.get("owner") or {}
        what = f"resuming from step {step}" if step else "starting"
        bar.write(f"{head}: {what} (worker {where.get('host')}:{where.get('pid')})")
      elif status in mf.FINISHED:
        loss = info.get("final_loss")
        tail = f" (final loss {loss:.4f})" if isinstance(loss, float) else ""
        tail += f": {info['error']}" if info.get("error") else ""
        bar.write(f"{head}: {status} in {float(info.get('wall_s') or 0):.1f}s{tail}")

  first = manifest.read() or {"runs": {}}
  for n in names:  # what the manifest says already (e.g. a dead worker's claim) is not news
    info = first["runs"].get(n, {})
    seen[n] = (info.get("status"), info.get("attempts"), info.get("resumed_from"))
  queue = collections.deque(units)
  active: dict[int, Started] = {}
  free = list(range(k))
  retries: collections.Counter = collections.Counter()
  stop: dict = {}
  old_handlers = _install_stop_handlers(stop)
  stopping = False
  try:
    while queue or active:
      if stop and not stopping:
        stopping = True
        bar.write(
          f"sweep {sweep.name}: stopping (signal {stop.get('signal')}); "
          + (
            "jobs keep running; run the same command to watch them again"
            if launcher.detach
            else "workers save a checkpoint; run the same command to continue"
          )
        )
        for s in active.values():
          launcher.stop(s)
        if launcher.detach:
          return EXIT_PREEMPTED
      m = manifest.read() or {"runs": {}}
      now = time.time()
      if not stopping:
        for unit in list(queue):
          if not free:
            break
          states = [mf.claim_state(m["runs"].get(n, {}), me, now) for n in unit]
          if all(s == "finished" for s in states):
            queue.remove(unit)
            continue
          if any(s == "held" for s in states):
            continue  # another worker (another sweep command, a cluster job) has it
          todo = [n for n, s in zip(unit, states) if s == "free"]
          queue.remove(unit)
          slot = slots[free.pop(0)]
          spec = _unit_spec(sweep, todo, m["runs"], uuid.uuid4().hex[:12], slot)
          try:
            active[slot.index] = launcher.start(spec, slot, todo)
          except Exception as e:  # noqa: BLE001 - e.g. sbatch refused the job
            free.append(slot.index)
            for n in todo:
              manifest.finish(n, None, "failed", error=f"could not start its worker: {e}")
      for idx, s in list(active.items()):
        res = launcher.poll(s)
        if res is None:
          continue
        rc, how = res
        del active[idx]
        free.append(idx)
        free.sort()
        _after_exit(manifest, s, rc, how, queue, retries, stopping)
      m = manifest.read() or {"runs": {}}
      report_changes(m)
      bar.update(m)
      if queue or active:
        time.sleep(poll_s)
  finally:
    for sig, h in old_handlers.items():
      signal.signal(sig, h)
    bar.update(manifest.read())
    bar.close()
  if stopping:
    return EXIT_PREEMPTED
  m = manifest.read() or {"runs": {}}
  return EXIT_FAILED if any(i.get("status") == "failed" for i in m["runs"].values()) else 0


def _after_exit(
  manifest: mf.Manifest, s: Started, rc: int, how: str, queue, retries, stopping: bool
) -> None:
  """A worker ended: anything it claimed but did not record, it did not survive."""
  m = manifest.read() or {"runs": {}}
  tail = _tail(s.log)
  where = f"; log {s.log}" + (f": {tail}" if tail else "") if s.log else ""
  again = []
  for n in s.names:
    info = m["runs"].get(n, {})
    status = info.get("status")
    if status == "running" and s.owns(info.get("owner")):
      wall = round(time.time() - float(info.get("claimed_at") or time.time()), 2)
      manifest.finish(
        n, info["owner"]["token"], "failed", error=f"worker {how}{where}", wall_s=wall
      )
    elif status == "pending" or (status == "running" and not info.get("owner")):
      if rc in (EXIT_NOT_CLAIMED, EXIT_PREEMPTED, 0, EXIT_FAILED) or stopping:
        again.append(n)  # given back (preempted), or someone else has it: look again
      else:  # the worker died before it could claim: it will not do better next time
        manifest.finish(n, None, "failed", error=f"worker {how} before training{where}")
  if again and not stopping:
    key = tuple(again)
    retries[key] += 1
    if retries[key] <= 3 or rc == EXIT_NOT_CLAIMED:
      queue.append(again)
    else:
      for n in again:
        manifest.finish(n, None, "failed", error=f"given back {retries[key]} times ({how})")
