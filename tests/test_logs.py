"""The metrics record: JSONL writer, truncation on resume, run and sweep readers (mhc_jax.logs)."""

import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest

from mhc_jax.logs import (
  JsonlWriter,
  load_events,
  load_run,
  load_summaries,
  load_sweep,
  read_jsonl,
  truncate_after,
)


def test_round_trip_numpy_jax_nan_and_lists(tmp_path):
  path = tmp_path / "m.jsonl"
  with JsonlWriter(path) as w:
    w.write(
      {
        "step": 0,
        "loss": np.float32(2.5),
        "grad_norm": jnp.asarray(1.0),
        "gain_fwd": np.array([1.0, 2.0], np.float32),
        "nonfinite": np.int64(0),
        "ok": np.bool_(True),
        "h": jnp.ones((2, 2), jnp.bfloat16),
      }
    )
    w.write(
      {
        "step": 1,
        "loss": float("nan"),
        "grad_norm": np.float64("inf"),
        "gain_fwd": jnp.array([np.nan, -np.inf]),
      }
    )
  assert w.closed
  recs = read_jsonl(path)
  assert recs[0] == {
    "step": 0,
    "loss": 2.5,
    "grad_norm": 1.0,
    "gain_fwd": [1.0, 2.0],
    "nonfinite": 0,
    "ok": True,
    "h": [[1.0, 1.0], [1.0, 1.0]],
  }
  assert math.isnan(recs[1]["loss"]) and recs[1]["grad_norm"] == math.inf
  assert math.isnan(recs[1]["gain_fwd"][0]) and recs[1]["gain_fwd"][1] == -math.inf
  assert path.read_text().count("\n") == 2  # one line per record
  with JsonlWriter(tmp_path / "x.jsonl") as w, pytest.raises(TypeError):
    w.write({"step": 0, "bad": object()})
  assert (tmp_path / "x.jsonl").read_text() == ""  # a bad record writes nothing


def test_writer_appends_and_repairs_partial_tail(tmp_path):
  path = tmp_path / "m.jsonl"
  with JsonlWriter(path, fsync=True) as w:
    w.write({"step": 0})
  with open(path, "a") as f:
    f.write('{"step": 1, "lo')  # a kill mid-write
  assert read_jsonl(path) == [{"step": 0}]
  with JsonlWriter(path) as w:
    w.write({"step": 1})
  assert read_jsonl(path) == [{"step": 0}, {"step": 1}]
  # a complete record that only lacks its newline is kept
  with open(path, "a") as f:
    f.write('{"step": 2}')
  with JsonlWriter(path) as w:
    w.write({"step": 3})
  assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2, 3]


def test_read_jsonl_rejects_corruption_in_the_middle(tmp_path):
  path = tmp_path / "m.jsonl"
  path.write_text('{"step": 0}\n{"st\n{"step": 2}\n')
  with pytest.raises(ValueError, match="corrupt"):
    read_jsonl(path)


def test_truncate_after_keeps_exactly_steps_up_to_k(tmp_path):
  path = tmp_path / "m.jsonl"
  with JsonlWriter(path) as w:
    for s in range(10):
      w.write({"step": s, "loss": 1.0 / (s + 1), "gain_fwd": [s, s]})
    w.write({"note": "no step: kept"})
  before = path.read_bytes().split(b"\n")
  with open(path, "a") as f:
    f.write('{"step": 10, "loss"')
  assert truncate_after(path, 6) == 3
  recs = read_jsonl(path)
  assert [r.get("step") for r in recs] == [0, 1, 2, 3, 4, 5, 6, None]
  assert path.read_bytes().split(b"\n")[:7] == before[:7]  # kept lines byte for byte
  assert path.read_bytes().endswith(b"\n")
  assert [p.name for p in tmp_path.iterdir()] == ["m.jsonl"]  # no temp file left
  assert truncate_after(path, 100) == 0 and len(read_jsonl(path)) == 8
  assert truncate_after(path, -1) == 7 and read_jsonl(path) == [{"note": "no step: kept"}]
  assert truncate_after(tmp_path / "missing.jsonl", 3) == 0


def _write_run(run_dir, steps=4, n_layers=2, lr=1e-3, depth=2, with_meta=True):
  run_dir.mkdir(parents=True)
  with JsonlWriter(run_dir / "metrics.jsonl") as w:
    for s in range(steps):
      w.write(
        {
          "step": s,
          "loss": 3.0 - 0.1 * s,
          "lr": lr * s,
          "gain_fwd": [1.0 + 0.1 * l + s for l in range(n_layers)],
          "attn_logit_max": [float(s)],
        }
      )
    w.write({"step": steps - 1, "eval": {"loss": 2.0}})  # merged into the same row
  with JsonlWriter(run_dir / "events.jsonl") as w:
    w.write({"step": 2, "kind": "spike/loss", "value": 9.0, "threshold": 4.0})
  if with_meta:
    (run_dir / "config.yaml").write_text(
      f"model:\n  depth: {depth}\n  mixer: mhc\noptim:\n  lr: {lr}\nseed: 0\n"
    )
    (run_dir / "summary.json").write_text(json.dumps({"final_loss": 2.7, "diverged": False}))


def test_load_run_wide_and_long(tmp_path):
  _write_run(tmp_path / "r", steps=4, n_layers=2)
  df = load_run(tmp_path / "r")
  assert df["step"].tolist() == [0, 1, 2, 3]
  assert df.columns[0] == "step"
  assert df["loss"].dtype == np.float64
  assert df.loc[1, "gain_fwd"] == [2.0, 2.1]
  assert df["eval.loss"].isna().tolist() == [True, True, True, False]
  assert df.attrs["config"] == {
    "model.depth": 2,
    "model.mixer": "mhc",
    "optim.lr": 0.001,
    "seed": 0,
  }
  assert df.attrs["summary"]["final_loss"] == 2.7

  lg = load_run(tmp_path / "r", long=True)
  assert list(lg.columns) == ["step", "metric", "layer", "value"]
  assert len(lg) == 4 * 2 + 4 * 1  # gain_fwd has 2 layers, attn_logit_max 1
  row = lg[(lg.metric == "gain_fwd") & (lg.step == 3) & (lg.layer == 1)]
  assert row["value"].item() == pytest.approx(4.1)
  assert sorted(lg.metric.unique()) == ["attn_logit_max", "gain_fwd"]
  assert lg.attrs["config"]["model.depth"] == 2

  ev = load_events(tmp_path / "r")
  assert ev.to_dict("records") == [
    {"step": 2, "kind": "spike/loss", "value": 9.0, "threshold": 4.0}
  ]
  empty = load_events(tmp_path)
  assert list(empty.columns) == ["step", "kind", "value", "threshold"] and len(empty) == 0


def test_load_run_without_metadata(tmp_path):
  _write_run(tmp_path / "r", with_meta=False)
  df = load_run(tmp_path / "r")
  assert df.attrs["config"] == {} and df.attrs["summary"] == {}


def _write_sweep(root):
  runs = {}
  for i, (lr, depth) in enumerate([(1e-3, 2), (1e-2, 2), (1e-3, 4)]):
    name = f"lr{lr}_d{depth}"
    _write_run(root / "runs" / name, steps=3 + i, n_layers=2 * depth, lr=lr, depth=depth)
    runs[name] = {
      "status": "done",
      "overrides": {"optim.lr": lr, "model.depth": depth, "lr": lr},
      "dir": f"runs/{name}",
    }
  runs["pending"] = {
    "status": "pending",
    "overrides": {"optim.lr": 1.0, "model.depth": 2, "lr": 1.0},
    "dir": "runs/pending",
  }
  (root / "manifest.json").write_text(json.dumps({"runs": runs}))
  return runs


def test_load_sweep_wide_long_and_summaries(tmp_path):
  _write_sweep(tmp_path)
  df = load_sweep(tmp_path)
  assert len(df) == 3 + 4 + 5
  assert list(df.columns[:4]) == [
    "run",
    "optim.lr",
    "model.depth",
    "override.lr",
  ]  # 'lr' is also a metric
  assert df.attrs["axes"] == {
    "optim.lr": "optim.lr",
    "model.depth": "model.depth",
    "lr": "override.lr",
  }
  assert set(df["run"]) == {"lr0.001_d2", "lr0.01_d2", "lr0.001_d4"}  # pending has no metrics
  assert df["model.depth"].dtype == np.int64
  last = df[df.run == "lr0.001_d4"].iloc[-1]
  assert last["step"] == 4 and len(last["gain_fwd"]) == 8 and last["lr"] == pytest.approx(4e-3)
  assert df.groupby("optim.lr")["run"].nunique().to_dict() == {1e-3: 2, 1e-2: 1}

  lg = load_sweep(tmp_path, long=True)
  assert list(lg.columns) == [
    "run",
    "optim.lr",
    "model.depth",
    "lr",
    "step",
    "metric",
    "layer",
    "value",
  ]
  n = {"lr0.001_d2": 3 * (4 + 1), "lr0.01_d2": 4 * (4 + 1), "lr0.001_d4": 5 * (8 + 1)}
  assert lg.groupby("run").size().to_dict() == n

  summ = load_summaries(tmp_path)
  assert summ["run"].tolist() == ["lr0.001_d2", "lr0.01_d2", "lr0.001_d4", "pending"]
  assert summ["status"].tolist() == ["done", "done", "done", "pending"]
  assert summ["final_loss"].tolist()[:3] == [2.7] * 3 and math.isnan(summ["final_loss"].iloc[3])
  assert summ["model.depth"].tolist() == [2, 2, 4, 2]


def test_load_sweep_with_no_finished_runs(tmp_path):
  (tmp_path / "manifest.json").write_text(
    json.dumps({"runs": {"a": {"status": "pending", "overrides": {"seed": 1}, "dir": "a"}}})
  )
  df = load_sweep(tmp_path)
  assert len(df) == 0 and list(df.columns) == ["run", "seed", "step"]
  with pytest.raises(FileNotFoundError):
    load_sweep(tmp_path / "nowhere")


def test_file_mode_preserved_by_truncate(tmp_path):
  path = tmp_path / "m.jsonl"
  with JsonlWriter(path) as w:
    w.write({"step": 0})
    w.write({"step": 1})
  os.chmod(path, 0o644)
  truncate_after(path, 0)
  assert (os.stat(path).st_mode & 0o777) == 0o644
