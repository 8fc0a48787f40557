"""Run directories, logs and summaries on an object store (``gs://``), offline: fsspec's
in-memory filesystem registered for the ``gs`` protocol stands in for Google Cloud Storage
(etils ``epath`` reaches ``gs://`` through fsspec). Nothing may land on the local disk, where
``pathlib`` would have put a ``gs:`` folder. Orbax checkpoints on ``gs://`` go through
tensorstore's own GCS driver, which has no offline stand-in; they are not tested here.
"""

from __future__ import annotations

import json
import math
import os

import pytest
from fake_gcs import keys as _keys  # the gcs fixture comes from conftest

from mhc_jax import logs, rundir, storage
from mhc_jax.errors import RunLocked
from mhc_jax.train.config import load_config, save_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_logs_and_config_go_to_the_object_store(gcs):
  run = f"{gcs}/runs/r1"
  cfg = load_config(os.path.join(ROOT, "configs", "debug.yaml"))
  save_config(cfg, f"{run}/config.yaml")
  assert load_config(f"{run}/config.yaml") == cfg
  with logs.JsonlWriter(f"{run}/metrics.jsonl") as w:
    for s in range(4):
      w.write({"step": s, "loss": 2.0 - s / 10, "gain_fwd": [1.0, 1.5]})
    w.flush()
    assert [r["step"] for r in logs.read_jsonl(f"{run}/metrics.jsonl")] == [0, 1, 2, 3]
    w.write({"step": 4, "loss": math.nan})
  assert logs.truncate_after(f"{run}/metrics.jsonl", 2) == 2  # a resume from checkpoint 3
  with logs.JsonlWriter(f"{run}/metrics.jsonl") as w:  # no appends on an object store
    w.write({"step": 3, "loss": 1.75})
  df = logs.load_run(run)
  assert df["step"].tolist() == [0, 1, 2, 3] and df["loss"].iloc[-1] == 1.75
  assert df.attrs["config"]["model.width"] == 16
  assert {"bucket/runs/r1/config.yaml", "bucket/runs/r1/metrics.jsonl"} <= _keys()


def test_run_directory_rules_lock_and_summary_on_the_object_store(gcs):
  run = storage.path(f"{gcs}/runs/r2")
  rundir.check(run, resume=False)  # nothing there yet
  with rundir.Lock(run):
    assert "bucket/runs/r2/.lock" in _keys()
    holder = json.loads((run / ".lock").read_text())
    assert holder["pid"] == os.getpid()
  assert "bucket/runs/r2/.lock" not in _keys()
  # another host's trainer holds it: refused, naming it; a dead process of this host: stale
  (run / ".lock").write_text(json.dumps({"pid": 1, "host": "tpu-worker-7", "started": 0}))
  with pytest.raises(RunLocked, match="pid 1 on host tpu-worker-7"):
    rundir.Lock(run).acquire()
  import socket

  dead = 2**22 + 12345
  (run / ".lock").write_text(json.dumps({"pid": dead, "host": socket.gethostname(), "started": 0}))
  with rundir.Lock(run):
    assert json.loads((run / ".lock").read_text())["pid"] == os.getpid()

  rundir.write_summary(run, {"status": "done", "steps": 4, "final_loss": math.nan})
  s = rundir.read_summary(run)
  assert s["status"] == "done" and math.isnan(s["final_loss"])
  for step in (2, 4):
    (run / "checkpoints" / str(step)).mkdir(parents=True)
  (run / "checkpoints" / "6.orbax-checkpoint-tmp-1").mkdir()
  assert rundir.checkpoint_steps(run) == {2, 4}
  with pytest.raises(Exception, match="already holds a run"):
    rundir.check(run, resume=False)
  (run / "config.yaml").write_text("name: r2\n")
  rundir.check(run, resume=True)


def test_a_recorder_writes_a_run_on_the_object_store(gcs):
  """The engine's host side (logs, events, rules, summary) for a run directory on gs://."""
  from mhc_jax.train.recorder import Recorder

  cfg = load_config(os.path.join(ROOT, "configs", "debug.yaml"), ["train.steps=3"])
  run = f"{gcs}/runs/r3"
  rec = Recorder(run, cfg, main=True)
  rec.begin(0, None)
  for step, loss in enumerate([2.3, math.nan, 2.1]):
    rec.record(
      step,
      {"loss": loss, "grad_norm": 1.0, "finite": math.isfinite(loss), "nonfinite": int(step >= 1)},
      has_eval=False,
      dt=0.01,
      tokens=128,
    )
  rec.flush()
  host = rec.host_state(3)
  summary = rec.finish("done", "", 3, None, 1)
  assert summary["final_loss"] == 2.1 and host["step"] == 3
  assert [r["step"] for r in logs.read_jsonl(f"{run}/metrics.jsonl")] == [0, 1, 2]
  assert [e["kind"] for e in logs.read_jsonl(f"{run}/events.jsonl")] == ["nonfinite"]
  assert rundir.read_summary(run)["status"] == "done"
  assert load_config(f"{run}/config.yaml").train.steps == 3


class _FakeCheckpoints:
  """Orbax reaches gs:// through tensorstore's own GCS driver, which has no offline stand-in:
  this stand-in marks each saved step as a directory through epath, which is all a sweep reads
  of the checkpoints of a run it does not resume."""

  def __init__(self, directory, keep=None, async_save=True):
    self.dir = storage.path(directory)

  def save(self, step, state, host, force=False):
    storage.write_json_atomic(self.dir / str(step) / "host.json", host)

  def latest(self):
    if not self.dir.exists():
      return None
    return max((int(p.name) for p in self.dir.iterdir() if p.name.isdigit()), default=None)

  def prune_after(self, step):
    pass

  def close(self):
    pass


def test_a_sweep_on_the_object_store(gcs, tmp_path_factory, monkeypatch, capsys):
  """``mhc-jax sweep --out gs://...``: the manifest, every run and the report land in the store,
  nothing on the local disk; the re-run reads the summaries there and trains nothing."""
  import yaml

  from mhc_jax import cli
  from mhc_jax.sweep import report
  from mhc_jax.train import loop

  monkeypatch.setattr(loop, "Checkpoints", _FakeCheckpoints)
  # the report is handed the sweep's gs:// path (the report's own object-store support is
  # report.py's and is tested there): the runner's part ends at the call
  reported = []
  monkeypatch.setattr(
    report, "write_report", lambda d: reported.append(d) or {"summary_md": f"{d}/report/summary.md"}
  )
  monkeypatch.setattr(report, "screen", lambda d: "")
  f = tmp_path_factory.mktemp("gs_sweep") / "s.yaml"
  f.write_text(
    yaml.safe_dump(
      {
        "name": "gs",
        "base": os.path.join(ROOT, "configs", "debug.yaml"),
        "set": {"model.mixer_options": {}, "train.steps": 3},
        "axes": {"model.mixer": ["residual", "mhc"]},
      }
    )
  )
  out = f"{gcs}/sweeps/gs"
  assert cli.main(["sweep", str(f), "--out", out, "--quiet"]) == 0
  keys = _keys()
  for name in ("mixer=residual", "mixer=mhc"):
    assert {f"bucket/sweeps/gs/runs/{name}/{k}" for k in ("config.yaml", "summary.json")} <= keys
    assert rundir.read_summary(f"{out}/runs/{name}")["status"] == "done"
  m = json.loads(storage.path(f"{out}/manifest.json").read_text())
  assert {n: i["status"] for n, i in m["runs"].items()} == dict.fromkeys(
    ("mixer=residual", "mixer=mhc"), "done"
  )
  assert [os.fspath(d) for d in reported] == [out]
  capsys.readouterr()
  assert cli.main(["sweep", str(f), "--out", out, "--quiet"]) == 0
  assert "all 2 runs are finished (2 done, 0 failed); nothing to do" in capsys.readouterr().out
