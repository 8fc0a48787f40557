"""Populations (mhc_jax.sweep.population): one vmapped program for runs that differ only in lr.

Three sweeps of the same tiny model over 4 learning rates, all through ``mhc-jax sweep``:
``pop`` (one population), ``sep`` (4 separate ``train.loop.train`` runs) and ``bad`` (a
population whose last member has lr = 1e30 and goes non-finite), plus ``pop_resume`` (``pop``
as a kill between two checkpoint saves leaves it, re-run). Built once per test session, shared
by xdist workers through a file lock. Tolerance: the population reproduces each separate run's
loss and grad norm to rtol 1e-5 (the lr is a traced value instead of a compile-time constant,
so float rounding may differ in the last bits); members of ``bad`` reproduce ``pop``'s members
to rtol 1e-6.
"""

from __future__ import annotations

import fcntl
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_sweep import _shared_dir

from mhc_jax import cli, logs
from mhc_jax.sweep import grid, population
from mhc_jax.train.config import ConfigError

REPO = Path(__file__).resolve().parents[1]
STEPS = 8
LRS = [1e-3, 3e-3, 1e-2, 3e-2]
NAMES = [f"lr={lr:g}" for lr in LRS]


def _sweep(root: Path, name: str, lrs, pop: bool) -> Path:
  # The plain residual compiles fastest; eval only in the populations (exercises the vmapped
  # eval; it does not touch training).
  data = {
    "name": name,
    "base": str(REPO / "configs" / "debug.yaml"),
    "set": {
      "train.steps": STEPS,
      "train.diag_every": 1,
      "train.log_every": 1,
      "train.ckpt_every": 4,
      "train.eval_every": 4 if pop else 0,
      "data.eval_batches": 1,
    },
    "axes": {"optim.lr": lrs},
  }
  if pop:
    data["population"] = ["optim.lr"]
  f = root / f"{name}.yaml"
  f.write_text(yaml.safe_dump(data))
  return f


def _run(f: Path, out: Path) -> int:
  return cli.main(["sweep", str(f), "--out", str(out), "--quiet"])


def _build(root: Path) -> dict:
  rec = {}
  for name, lrs, pop in (("pop", LRS, True), ("sep", LRS, False), ("bad", LRS[:3] + [1e30], True)):
    rec[name] = _run(_sweep(root, name, lrs, pop), root / name)
  # same shapes: the compiled population program is reused, not rebuilt
  rec["programs_of_4"] = len([k for k in population._CACHE if k[1] == 4])
  # a population killed while saving step 8 (only member 0 got it): no summaries, "running"
  out = root / "pop_resume"
  shutil.copytree(root / "pop", out)
  m = json.loads((out / "manifest.json").read_text())
  for i, name in enumerate(NAMES):
    m["runs"][name]["status"] = "running"
    (out / "runs" / name / "summary.json").unlink()
    if i > 0:
      shutil.rmtree(out / "runs" / name / "checkpoints" / "8")
  (out / "manifest.json").write_text(json.dumps(m))
  rec["pop_resume"] = _run(root / "pop.yaml", out)
  return rec


@pytest.fixture(scope="session")
def sweeps(tmp_path_factory):
  root = _shared_dir(tmp_path_factory) / "population"
  root.mkdir(exist_ok=True)
  with open(root / "lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (root / "record.json").exists():
      rec = _build(root)
      (root / "record.json").write_text(json.dumps(rec))
    rec = json.loads((root / "record.json").read_text())
  assert {k: rec[k] for k in ("pop", "sep", "bad", "pop_resume")} == dict.fromkeys(
    ("pop", "sep", "bad", "pop_resume"), 0
  )
  return {"root": root, "record": rec, **{k: root / k for k in ("pop", "sep", "bad", "pop_resume")}}


def _series(run_dir: Path, key: str) -> np.ndarray:
  return np.asarray([r[key] for r in logs.read_jsonl(run_dir / "metrics.jsonl")], np.float64)


@pytest.mark.slow
def test_population_matches_separate_runs(sweeps):
  for name, lr in zip(NAMES, LRS):
    p, s = sweeps["pop"] / "runs" / name, sweeps["sep"] / "runs" / name
    assert [r["step"] for r in logs.read_jsonl(p / "metrics.jsonl")] == list(range(STEPS))
    for key, rtol in (("loss", 1e-5), ("grad_norm", 1e-5), ("param_norm", 1e-4)):
      # param_norm gets 1e-4: Adam's m / (sqrt(v) + eps) turns last-bit differences of
      # near-zero gradients into O(lr) differences of a few parameters
      a = logs.load_run(p)[key].to_numpy(np.float64)
      b = logs.load_run(s)[key].to_numpy(np.float64)
      np.testing.assert_allclose(a, b, rtol=rtol, err_msg=f"{name} {key}")
    a = np.asarray(logs.load_run(p)["gain_fwd"].tolist())
    b = np.asarray(logs.load_run(s)["gain_fwd"].tolist())
    np.testing.assert_allclose(a, b, rtol=1e-5)
    kl = logs.load_run(p)["eval/kl_bits"].dropna()
    assert list(kl.index) == [3, 7] and np.isfinite(kl).all()
    # each member is a normal run directory
    assert yaml.safe_load((p / "config.yaml").read_text())["optim"]["lr"] == lr
    summ = json.loads((p / "summary.json").read_text())
    ref = json.loads((s / "summary.json").read_text())
    assert summ["status"] == "done" and summ["steps"] == STEPS
    assert summ["params"] == ref["params"] and summ["population"]["size"] == 4
    assert sorted(int(c.name) for c in (p / "checkpoints").iterdir()) == [4, 8]
  m = json.loads((sweeps["pop"] / "manifest.json").read_text())
  assert {i["status"] for i in m["runs"].values()} == {"done"}


@pytest.mark.slow
def test_nonfinite_member_leaves_the_others_alone(sweeps):
  for name in NAMES[:3]:
    a = _series(sweeps["bad"] / "runs" / name, "loss")
    np.testing.assert_allclose(a, _series(sweeps["pop"] / "runs" / name, "loss"), rtol=1e-6)
    np.testing.assert_allclose(a, _series(sweeps["sep"] / "runs" / name, "loss"), rtol=1e-5)
    assert (
      json.loads((sweeps["bad"] / "runs" / name / "summary.json").read_text())["nonfinite"] == 0
    )
  # lr 1e30: the first real update (step 1) blows the parameters up; from then on every
  # gradient is NaN and every update is skipped (the loss sits at ln V, uniform output)
  bad = sweeps["bad"] / "runs" / "lr=1e+30"
  gnorm = _series(bad, "grad_norm")
  assert np.isfinite(gnorm[:2]).all() and not np.isfinite(gnorm[2:]).any()
  summ = json.loads((bad / "summary.json").read_text())
  assert summ["nonfinite"] == STEPS - 2
  # a member that skips every update has diverged (it is not `done`): after `patience` (5)
  # non-finite steps in a row the divergence rule fires, with its reason in the event the
  # report reads; training went on (train.halt_on_divergence is off)
  assert summ["status"] == "diverged", summ
  assert summ["divergence"] == {"step": 6, "reason": "nonfinite"}
  events = logs.read_jsonl(bad / "events.jsonl")
  assert [e["kind"] for e in events].count("nonfinite") == summ["nonfinite"]
  assert [(e["step"], e["reason"]) for e in events if e["kind"] == "divergence"] == [
    (6, "nonfinite")
  ]
  assert not [e for e in events if e["kind"].startswith("spike/")]  # not also spikes
  assert sweeps["record"]["programs_of_4"] == 1  # one compiled program for both populations


@pytest.mark.slow
def test_population_resumes_from_a_common_checkpoint(sweeps):
  out = sweeps["pop_resume"]
  m = json.loads((out / "manifest.json").read_text())
  assert {i["status"] for i in m["runs"].values()} == {"done"}
  for name in NAMES:
    rdir = out / "runs" / name
    assert [r["step"] for r in logs.read_jsonl(rdir / "metrics.jsonl")] == list(range(STEPS))
    np.testing.assert_allclose(
      _series(rdir, "loss"), _series(sweeps["pop"] / "runs" / name, "loss"), rtol=1e-6
    )


def test_members_must_share_everything_but_the_population_keys(tmp_path):
  sw = grid.read_sweep(_sweep(tmp_path, "x", LRS[:2], True))
  cfgs = [r.cfg for r in sw.runs]
  population.check_members(cfgs)  # lr differs: fine
  import dataclasses

  other = dataclasses.replace(cfgs[1], model=dataclasses.replace(cfgs[1].model, depth=2))
  with pytest.raises(ConfigError, match=r"^model.depth: population members differ"):
    population.check_members([cfgs[0], other])


@pytest.mark.parametrize("stacked", [False, True])
def test_an_inactive_member_is_frozen_while_the_others_step(stacked):
  """Shared and stacked batches: after 2 steps with diagnostics the active member has stepped
  twice and the inactive one not at all (its parameters and optimiser state as initialised)."""
  import jax

  from mhc_jax.train.config import load_config
  from mhc_jax.train.loop import host_batch, prepare

  lrs, active = np.asarray([3e-2, 1e-2], np.float32), np.asarray([True, False])
  setup = prepare(load_config(REPO / "configs" / "debug.yaml", []))
  cfg, mesh = setup.cfg, setup.mesh
  prog = population.programs(cfg, mesh, len(lrs), stacked_batch=stacked)
  state = prog.init_all([cfg] * len(lrs))
  init = jax.device_get(state)
  host = [host_batch(setup.source, cfg, i) for i in range(len(lrs) if stacked else 1)]
  batch = population.put_batches(host, mesh, stacked)
  args = (jax.device_put(lrs), jax.device_put(active), batch, True)
  for _ in range(2):
    state, _ = prog.step(state, *args)
  out = jax.device_get(state)
  assert out.step.tolist() == [2, 0]
  for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(init)):
    np.testing.assert_array_equal(got[1], want[1])
  assert any(
    not np.array_equal(g[0], w[0])
    for g, w in zip(jax.tree.leaves(out.params), jax.tree.leaves(init.params))
  )
