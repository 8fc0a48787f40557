"""Stream spread across depth for mixers and initialisations (docs/mixers.md, "Symmetry").

Trains each case with `mhc-jax train` on byte-level text (depth 32, width 32, n = 4, 8 x 64
bytes, lr 1e-2, warm-up 15 (or the whole run if shorter), clipping off, 150 steps: the setting in which the symmetric mHC
init was found to collapse its streams) and prints, from the run's last diagnostic record, the
relative stream spread RMS(x - mean over streams) / RMS(x) after mixer layers 0, L/4, L/2, 3L/4
and the last, and the mean train loss of the last 8 steps.

  .venv/bin/python benchmarks/stream_spread.py                       # the default cases
  .venv/bin/python benchmarks/stream_spread.py mhc mhc:stream_init=symmetric mhc:res_diag=0.95
  .venv/bin/python benchmarks/stream_spread.py --depth 8 --steps 50 hc   # a quick look

A case is ``mixer[:key=value[:key=value...]]`` (mixer options). Cost: 1-2 minutes a case on 2
free CPU cores at the default size.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CASES = [
  "residual",
  "hc",
  "hc:stream_init=symmetric",
  "mhc",
  "mhc:stream_init=hc",
  "mhc:stream_init=symmetric",
  "mhc:stream_init=symmetric:res_diag=0.95",
  "mhc_lite",
  "kromhc",
  "mhc_identity",
  "mhc_identity:stream_init=symmetric",
  "frac",
]


def parse_case(case: str) -> tuple[str, list[str]]:
  """``"mhc:stream_init=symmetric"`` -> ``("mhc", ["model.mixer_options.stream_init=symmetric"])``."""
  mixer, *opts = case.split(":")
  bad = [o for o in opts if "=" not in o]
  if not mixer or bad:
    raise ValueError(f"case {case!r}: expected mixer[:key=value...]")
  return mixer, [f"model.mixer_options.{o}" for o in opts]


def run_case(case: str, depth: int, steps: int, out: Path) -> dict:
  mixer, opts = parse_case(case)
  cmd = [
    sys.executable,
    "-m",
    "mhc_jax.cli",
    "train",
    "--config",
    str(REPO / "configs" / "text.yaml"),
    "--out",
    str(out),
    "--quiet",
    "--set",
    f"model.depth={depth}",
    "model.width=32",
    f"model.mixer={mixer}",
    "data.seq_len=64",
    "data.batch_size=8",
    "optim.lr=1e-2",
    f"optim.warmup_steps={min(15, steps)}",
    "optim.clip=0",
    f"train.steps={steps}",
    "train.log_every=1",
    "train.diag_every=10",
    f"train.eval_every={steps}",
    "data.eval_batches=2",
    "train.ckpt_every=0",
    *opts,
  ]
  subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
  recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  last = [r for r in recs if "stream_spread" in r][-1]
  losses = [r["loss"] for r in recs if "loss" in r][-8:]
  s = last["stream_spread"]
  n = len(s)
  return {
    "case": case,
    "step": last["step"],
    "spread": [s[i] for i in (0, n // 4, n // 2, 3 * n // 4, n - 1)],
    "loss": sum(losses) / len(losses),
  }


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("cases", nargs="*", default=DEFAULT_CASES)
  ap.add_argument("--depth", type=int, default=32)
  ap.add_argument("--steps", type=int, default=150)
  a = ap.parse_args(argv)
  try:
    for c in a.cases:
      parse_case(c)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"depth {a.depth} (2L = {2 * a.depth} mixer layers), width 32, {a.steps} steps")
  print(f"{'case':42s} {'spread after layer 0, L/4, L/2, 3L/4, last':46s} loss")
  with tempfile.TemporaryDirectory() as tmp:
    for i, c in enumerate(a.cases):
      r = run_case(c, a.depth, a.steps, Path(tmp) / f"run{i}")
      cells = " ".join(f"{v:8.3f}" for v in r["spread"])
      print(f"{c:42s} {cells:46s} {r['loss']:.3f}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
