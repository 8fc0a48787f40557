"""Redesign parity: the quickstart's loss curve and diagnostic metrics for every mixer, on one
device and on 8 simulated devices, recorded before the house was rebuilt (issue 34) and
compared after it at 1e-5.

  python tests/parity.py --write   # record tests/data/parity_before_redesign.json (once)

``tests/test_parity.py`` re-trains each case and compares every recorded number. A metric that
the redesign renames must be mapped here explicitly, not dropped.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys
import tempfile

if __name__ == "__main__":  # before jax is imported: 8 simulated devices, as the tests have
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")  # as tests/conftest.py
  sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))

GOLD = pathlib.Path(__file__).parent / "data" / "parity_before_redesign.json"
MIXERS = (
  "residual",
  "hc",
  "mhc",
  "mhc_lite",
  "mhc_identity",
  "kromhc",
  "frac",
  "value_residual",
  "laurel",
  "ortho",
  "deepnorm",
  "post_ln",
  "peri_ln",
  "denseformer",
  "attnres",
)
DEVICES = (1, 8)
# configs/quickstart.yaml as it was when recorded (copied here, so the demo may change), then
# 4 steps, diagnostics at steps 0 and 2, batch 8 (divisible by 8 devices), 16 tokens.
OVERRIDES = (
  "name=quickstart",
  "model.depth=2",
  "model.width=32",
  "model.heads=2",
  "data.task=bijection",
  "data.options.n_symbols=8",
  "optim.lr=3e-3",
  "train.steps=4",
  "optim.warmup_steps=2",
  "train.log_every=1",
  "train.diag_every=2",
  "train.eval_every=0",
  "train.ckpt_every=0",
  "data.batch_size=8",
  "data.seq_len=16",
)


def record(mixer: str, devices: int) -> dict[str, list[float]]:
  """Train the case and return every finite number in metrics.jsonl, keyed ``step/name``."""
  import jax

  from mhc_jax.train.config import load_config
  from mhc_jax.train.loop import prepare, train

  cfg = load_config(None, [*OVERRIDES, f"model.mixer={mixer}", f"mesh.data={devices}"])
  setup = prepare(cfg, devices=jax.devices()[:devices])
  with tempfile.TemporaryDirectory() as tmp:
    run = pathlib.Path(tmp) / "run"
    train(setup, run, progress=False)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  out: dict[str, list[float]] = {}
  for row in rows:
    step = row.get("step")
    for k, v in row.items():
      if k in ("step", "step_time_s", "tokens_per_s"):
        continue
      vals = v if isinstance(v, list) else [v]
      if vals and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in vals):
        if all(math.isfinite(x) for x in vals):
          out[f"{step}/{k}"] = [float(x) for x in vals]
  return out


def main() -> None:
  if "--write" not in sys.argv:
    sys.exit("usage: python tests/parity.py --write")
  gold = {f"{m}@{d}": record(m, d) for m in MIXERS for d in DEVICES}
  GOLD.write_text(json.dumps(gold, indent=0, sort_keys=True) + "\n")
  print(f"wrote {GOLD}: {len(gold)} cases, {sum(len(v) for v in gold.values())} series")


if __name__ == "__main__":
  main()
