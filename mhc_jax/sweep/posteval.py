"""Post-run evaluation for a sweep: ``eval: N`` in a sweep file runs ``mhc-jax eval`` (posterior
fidelity and the geometry probes, :mod:`mhc_jax.evaluate`) on N validation batches of every
finished run, before the report is written, so the report's ``eval_*`` and ``probe_*`` columns
(and ``groups.csv``'s intervals over seeds) have them.

Each run's result goes to its own ``eval.json`` (written atomically). A run whose ``eval.json``
is already there for its last checkpoint is skipped, so a killed sweep re-run evaluates only
the rest. A failed evaluation is reported and leaves that run's columns NaN; it does not fail
the sweep.
"""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
from typing import Callable

__all__ = ["pending", "evaluate_runs"]


def _eval_step(run_dir: Path) -> int | None:
  try:
    return int(json.loads((run_dir / "eval.json").read_text())["step"])
  except (OSError, ValueError, KeyError, TypeError):
    return None


def pending(out_dir: str | Path, manifest: dict) -> list[tuple[str, Path]]:
  """(name, run directory) of the done runs whose eval.json is missing or older than their last
  checkpoint, in manifest order."""
  from mhc_jax.rundir import checkpoint_steps

  out_dir = Path(out_dir)
  todo = []
  for name, info in manifest.get("runs", {}).items():
    if info.get("status") != "done":
      continue
    rdir = out_dir / info["dir"]
    last = max(checkpoint_steps(rdir), default=None)
    if last is not None and _eval_step(rdir) != last:
      todo.append((name, rdir))
  return todo


def evaluate_runs(
  out_dir: str | Path, manifest: dict, batches: int, say: Callable[[str], None] = print
) -> int:
  """Evaluate every :func:`pending` run on `batches` validation batches; returns how many
  failed."""
  from mhc_jax.evaluate import evaluate_run, write_json_atomic

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
    write_json_atomic(rdir / "eval.json", result)
    kl = result.get("metrics", {}).get("kl_bits")
    what = f"KL {kl:.4f} bits" if isinstance(kl, float) else "done"
    say(f"eval [{i}/{len(todo)}] {name}: {what} ({time.perf_counter() - t0:.1f}s)")
  return failed
