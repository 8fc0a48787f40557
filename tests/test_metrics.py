"""The metric registry (mhc_jax.metrics) against what a real training run writes, the report's
columns and docs/interfaces.md."""

import json
import pathlib

import pytest

from mhc_jax import metrics
from mhc_jax.sweep import report

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = (  # tests/parity.py's case, with evaluations on the bijection wind tunnel
  "model.depth=2",
  "model.width=32",
  "model.heads=2",
  "data.task=bijection",
  "data.options.n_symbols=8",
  "data.target=posterior",
  "data.eval_batches=1",
  "train.steps=4",
  "optim.warmup_steps=2",
  "train.log_every=1",
  "train.diag_every=1",  # every key a step writes, without compiling the non-diagnostic step
  "train.eval_every=2",
  "train.ckpt_every=0",
  "data.batch_size=8",
  "data.seq_len=16",
)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
  """(metrics.jsonl keys, summary.json keys) of short hc and residual runs: every metric is
  written by one of them (hc has H_res, streams and a Sinkhorn-free mixing; residual none)."""
  import jax

  from mhc_jax.train.config import load_config
  from mhc_jax.train.loop import prepare, train

  keys, summary = set(), set()
  for mixer in ("hc", "mhc", "residual"):
    cfg = load_config(None, [*TINY, f"model.mixer={mixer}", "mesh.data=1"])
    run = tmp_path_factory.mktemp(mixer) / "run"
    train(prepare(cfg, devices=jax.devices()[:1]), run, progress=False)
    for line in (run / "metrics.jsonl").read_text().splitlines():
      keys |= set(json.loads(line)) - {"step"}
    summary |= set(json.loads((run / "summary.json").read_text()))
  return keys, summary


def test_every_written_key_is_registered_and_every_entry_is_written(written):
  keys, summary = written
  names = set(metrics.by_name())
  assert keys - names == set(), "written but not in mhc_jax/metrics.py"
  assert names - keys == set(), "in mhc_jax/metrics.py but written by no mixer"
  fields = {k for k in summary if not k.startswith("eval/")}
  assert fields == set(metrics.SUMMARY_FIELDS) - {"eval/*"}
  assert any(k.startswith("eval/") for k in summary)


def test_registry_entries_are_well_formed():
  assert len(metrics.by_name()) == len(metrics.METRICS)  # one entry per name
  for m in metrics.METRICS:
    assert m.shape in ("scalar", "layer", "block", "position"), m.name
    assert m.when in ("step", "diag", "eval"), m.name
    assert m.plot in (None, "curve", "depth", "layer", "heatmap"), m.name
    assert set(m.summary.values()) <= set(metrics.REDUCTIONS), m.name
    assert m.meaning and "\n" not in m.meaning, m.name
  cols = [c for m in metrics.METRICS for c in m.summary]
  assert len(cols) == len(set(cols))  # one metric per report column


def test_report_columns_come_from_the_registry():
  from_registry = {c for m in metrics.METRICS for c in m.summary}
  assert from_registry <= set(report.COLUMN_DOCS)
  rest = set(report.COLUMN_DOCS) - from_registry  # run state, events and eval.json
  assert rest == {"status", "steps", "spike_count", "nonfinite", "note", *report._EVAL_FIELDS}
  assert report.LOG_SCALE == metrics.log_columns()


def test_interfaces_md_carries_the_registry_table():
  text = (ROOT / "docs" / "interfaces.md").read_text()
  assert metrics.markdown_table() in text, (
    "docs/interfaces.md's metric table is out of date: paste "
    "python -c 'from mhc_jax import metrics; print(metrics.markdown_table())'"
  )
