"""The sweep manifest (mhc_jax.sweep.manifest): transactions that concurrent processes cannot
corrupt, claims that only one worker wins, leases that let a dead worker's runs be taken over,
results only the owner can record. No JAX here: plain processes racing on one directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from mhc_jax.sweep import manifest as mf
from mhc_jax.sweep.manifest import Heartbeat, Manifest, ManifestError, Worker, claim_state

REPO = Path(__file__).resolve().parents[1]


def _new(tmp_path: Path, names=("a", "b", "c")) -> Manifest:
  m = Manifest(tmp_path / "s")
  m.transact(
    lambda d: d.update(
      name="t", runs={n: {"status": "pending", "dir": f"runs/{n}", "overrides": {}} for n in names}
    )
  )
  return m


def _run_all(code: str, n: int, *args) -> list[str]:
  """Start `n` Python processes running `code` at once; their stdout."""
  env = dict(os.environ, PYTHONPATH=str(REPO))
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", textwrap.dedent(code), str(i), *map(str, args)],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      env=env,
    )
    for i in range(n)
  ]
  outs = []
  for p in procs:
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    outs.append(out)
  return outs


def test_transaction_writes_atomically_and_counts(tmp_path):
  m = _new(tmp_path)
  d = m.read()
  assert d["seq"] == 1 and d["runs"]["a"]["status"] == "pending"
  assert (tmp_path / "s" / "manifest.lock").read_text() == "1"
  # no change, no write: the file (and its sequence number) stay as they are
  before = (tmp_path / "s" / "manifest.json").read_bytes()
  assert m.transact(lambda d: 42) == 42
  assert (tmp_path / "s" / "manifest.json").read_bytes() == before
  m.transact(lambda d: d["runs"]["a"].update(status="done"))
  assert m.read()["seq"] == 2 and m.read()["runs"]["a"]["status"] == "done"
  assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["manifest.json", "manifest.lock"]


def test_concurrent_processes_lose_no_update(tmp_path):
  """4 processes x 40 read-modify-write increments of one counter (and one key each): with the
  lock every increment survives; a plain read/write would lose many of them."""
  m = _new(tmp_path)
  m.transact(lambda d: d.update(counter=0))
  code = """
    import sys
    from mhc_jax.sweep.manifest import Manifest
    i, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    m = Manifest(path)
    def bump(d):
      d["counter"] += 1
      by = d.setdefault("by", {})
      by[i] = by.get(i, 0) + 1
    for _ in range(n):
      m.transact(bump)
  """
  _run_all(code, 4, tmp_path / "s", 40)
  d = m.read()
  assert d["counter"] == 160
  assert d["by"] == {str(i): 40 for i in range(4)}
  assert d["seq"] == 1 + 1 + 160


def test_racing_claims_each_run_claimed_once(tmp_path):
  """6 workers claim the same 5 runs at once and stay alive (a dead owner's runs are free to
  take): every run has exactly one owner, the one the manifest names."""
  names = [f"r{i}" for i in range(5)]
  m = _new(tmp_path, names)
  code = """
    import json, os, sys, time
    from mhc_jax.sweep.manifest import Manifest, Worker
    i, path, names, done = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4]
    me = Worker.current()
    got, why = Manifest(path).claim(names, me)
    with open(os.path.join(done, i + ".json"), "w") as f:
      f.write(json.dumps({"token": me.token, "got": got}))
    while not os.path.exists(os.path.join(done, "release")):
      time.sleep(0.02)
  """
  done = tmp_path / "done"
  done.mkdir()
  env = dict(os.environ, PYTHONPATH=str(REPO))
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        "-c",
        textwrap.dedent(code),
        str(i),
        str(tmp_path / "s"),
        ",".join(names),
        str(done),
      ],
      env=env,
    )
    for i in range(6)
  ]
  try:
    deadline = time.time() + 120
    while len(list(done.glob("*.json"))) < 6 and time.time() < deadline:
      assert all(p.poll() is None for p in procs)
      time.sleep(0.05)
    outs = [json.loads(f.read_text()) for f in sorted(done.glob("*.json"))]
    d = m.read()
  finally:
    (done / "release").touch()
    for p in procs:
      p.wait(timeout=60)
  assert len(outs) == 6
  winners = [n for o in outs for n in o["got"]]
  assert sorted(winners) == names  # each run claimed, and only once
  for o in outs:
    for n in o["got"]:
      assert d["runs"][n]["owner"]["token"] == o["token"]
      assert d["runs"][n]["status"] == "running" and d["runs"][n]["attempts"] == 1


def _fake_owner(**kw) -> dict:
  o = {
    "token": "other",
    "host": "elsewhere",
    "machine": "elsewhere/boot/pid:[1]",
    "pid": 1,
    "started": 1,
    "job": None,
  }
  o.update(kw)
  return o


def test_lease_and_liveness():
  me = Worker.current()
  now = time.time()
  running = lambda owner, hb=now: {"status": "running", "owner": owner, "heartbeat": hb}  # noqa: E731
  assert claim_state({"status": "pending"}, me) == "free"
  assert claim_state({"status": "done"}, me) == "finished"
  assert claim_state({"status": "failed"}, me) == "finished"
  assert claim_state(running(me.as_dict()), me) == "mine"
  # another host: its heartbeat decides
  assert claim_state(running(_fake_owner(), now - 5), me, now, lease_s=60) == "held"
  assert claim_state(running(_fake_owner(), now - 61), me, now, lease_s=60) == "free"
  # this machine: the process decides, whatever the heartbeat says
  alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    w = Worker.current()
    o = _fake_owner(machine=me.machine, pid=alive.pid, started=mf._start_time(alive.pid))
    assert claim_state(running(o, now - 1e6), w, now, lease_s=60) == "held"
    o_reused = dict(o, started=(o["started"] or 0) + 1)  # same pid, another process
    assert claim_state(running(o_reused, now), w, now, lease_s=60) == "free"
  finally:
    alive.kill()
    alive.wait()
  assert claim_state(running(o, now), w, now, lease_s=60) == "free"  # its process is gone
  # a later life of the same cluster job takes over at once
  job_me = Worker("t2", "h", "h/b/p", 5, 5, "slurm:77")
  assert claim_state(running(_fake_owner(job="slurm:77"), now), job_me, now, 60) == "free"
  assert claim_state(running(_fake_owner(job="slurm:78"), now), job_me, now, 60) == "held"


def test_dead_owner_is_taken_over_and_the_old_owner_cannot_record(tmp_path):
  m = _new(tmp_path)
  old = Worker("old", "elsewhere", "elsewhere/b/p", 1, 1, None)
  assert m.claim(["a", "b"], old)[0] == ["a", "b"]
  me = Worker.current()
  got, why = m.claim(["a", "b"], me)
  assert got == [] and why == {"a": "held by elsewhere:1", "b": "held by elsewhere:1"}
  # the old owner goes silent past the lease
  m.transact(lambda d: d["runs"]["a"].update(heartbeat=time.time() - 10 * mf.lease_seconds()))
  got, _ = m.claim(["a"], me)
  assert got == ["a"]
  info = m.read()["runs"]["a"]
  assert info["owner"]["token"] == me.token and info["attempts"] == 2
  assert "from elsewhere:1" in info["taken_over"]
  # the old owner wakes up: its heartbeat says it lost the run, its result is refused
  assert m.heartbeat(["a", "b"], old) == ["a"]
  assert m.finish("a", "old", "done", wall_s=1.0) is False
  assert m.read()["runs"]["a"]["status"] == "running"
  assert m.finish("a", me.token, "done", wall_s=2.0, final_loss=1.5) is True
  info = m.read()["runs"]["a"]
  assert info["status"] == "done" and "owner" not in info and info["final_loss"] == 1.5
  assert claim_state(info, me) == "finished"
  assert m.claim(["a"], me)[0] == []


def test_heartbeat_renews_and_reports_a_lost_claim(tmp_path, monkeypatch):
  monkeypatch.setenv("MHC_SWEEP_LEASE_S", "1.2")
  m = _new(tmp_path)
  me = Worker.current()
  m.claim(["a", "b"], me)
  t0 = m.read()["runs"]["a"]["heartbeat"]
  lost = []
  with Heartbeat(m, me, ["a", "b"], on_lost=lost.extend):
    time.sleep(0.7)
    assert m.read()["runs"]["a"]["heartbeat"] > t0  # renewed every lease/6
    thief = Worker("thief", "h", "h/b/p", 2, 2, None)
    m.transact(lambda d: d["runs"]["b"].update(owner=thief.as_dict()))
    deadline = time.time() + 5
    while not lost and time.time() < deadline:
      time.sleep(0.05)
  assert lost == ["b"]


def test_a_writer_waits_for_the_latest_manifest(tmp_path):
  """As on NFS with a cached directory entry: the lock file says seq 3 was written but the
  file read is still seq 2; the writer waits until it reads seq 3 and builds on that."""
  m = _new(tmp_path)
  m.transact(lambda d: d.update(x=1))  # seq 2
  old = (tmp_path / "s" / "manifest.json").read_text()
  m.transact(lambda d: d.update(x=2))  # seq 3
  new = (tmp_path / "s" / "manifest.json").read_text()
  (tmp_path / "s" / "manifest.json").write_text(old)  # the stale view

  def catch_up():  # atomically, as the writer does: a reader never sees a half-written file
    time.sleep(0.4)
    (tmp_path / "s" / "manifest.tmp").write_text(new)
    os.replace(tmp_path / "s" / "manifest.tmp", tmp_path / "s" / "manifest.json")

  threading.Thread(target=catch_up).start()
  t0 = time.time()
  m.transact(lambda d: d.update(x=d["x"] + 10))
  assert time.time() - t0 >= 0.3
  d = m.read()
  assert d["x"] == 12 and d["seq"] == 4


def test_unreadable_manifest_is_an_error(tmp_path):
  (tmp_path / "manifest.json").write_text("{not json")
  with pytest.raises(ManifestError, match="not valid JSON"):
    Manifest(tmp_path).read()
  (tmp_path / "manifest.json").write_text(json.dumps({"runs": []}))
  with pytest.raises(ManifestError, match="no 'runs' mapping"):
    Manifest(tmp_path).read()
