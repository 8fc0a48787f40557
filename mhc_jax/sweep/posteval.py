"""Post-run evaluation for a sweep (``eval: N``): ``mhc-jax eval`` on N validation batches of every
finished run, before the report, into its ``eval.json``; docs/interfaces.md ("Run directory")."""

from __future__ import annotations

import time
import traceback
from typing import Callable

from mhc_jax import rundir, storage


def pending(out_dir, manifest: dict) -> list:
  """(name, run directory) of the done runs whose eval.json is missing or older than their last
  checkpoint, in manifest order."""
  todo = []
  for name, info in manifest.get("runs", {}).items():
    rdir = storage.path(out_dir) / info["dir"]
    last = max(rundir.checkpoint_steps(rdir), default=None)
    done = (storage.read_json(rdir / "eval.json") or {}).get("step")
    if info.get("status") == "done" and last is not None and done != last:
      todo.append((name, rdir))
  return todo


def evaluate_runs(out_dir, manifest: dict, batches: int, say: Callable[[str], None] = print) -> int:
  """Evaluate every :func:`pending` run on `batches` validation batches; returns how many
  failed."""
  from mhc_jax.evaluate import evaluate_run

  todo = pending(out_dir, manifest)
  failed = 0
  for i, (name, rdir) in enumerate(todo, 1):
    t0 = time.perf_counter()
    try:
      result = evaluate_run(rdir, batches)
    except Exception as e:  # noqa: BLE001 - one run's evaluation must not stop the report
      traceback.print_exc()
      say(f"eval [{i}/{len(todo)}] {name}: failed: {type(e).__name__}: {e}")
      failed += 1
      continue
    storage.write_json_atomic(rdir / "eval.json", result)
    kl = result.get("metrics", {}).get("kl_bits")
    what = f"KL {kl:.4f} bits" if isinstance(kl, float) else "done"
    say(f"eval [{i}/{len(todo)}] {name}: {what} ({time.perf_counter() - t0:.1f}s)")
  return failed
