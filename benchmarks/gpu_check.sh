#!/usr/bin/env bash
# Device check for one 10-minute accelerator slot (about 8 minutes on one H100/H200): the train
# step at a GPU size, then the studies' GPU-sized variants, briefly. Prints a table and writes
# everything as JSON; writes nothing in the repository.
#
#   1. benchmarks/step_bench.py, width 2048, 8 blocks, 16 heads, 8 x 1024 tokens, n = 4 streams,
#      bfloat16 compute: step time, tokens/s, model TFLOP/s and MFU against the device's own
#      bf16 matmul rate (an 8192^3 bf16 matmul, timed in the same rounds) for residual, hc, mhc
#      and mhc_lite, each mixer's step over residual's; before that, attention's forward +
#      backward alone at 8 x 16 heads x 1024 x 128 in bf16, each model.attention formulation
#      side by side (materialized, xla, jax's whole-[T, T] XLA form, cudnn).
#   2. benchmarks/study_cost.py: each study's costliest GPU-variant run for a few steps, and the
#      projected device-hours of the whole study.
#
#   pip install -e '.[cuda13]'     # once, on the GPU machine (CUDA 13 driver; '.[cuda12]' on a
#                                  # CUDA 12 driver; see launch/README.md). Or, where an image
#                                  # ships jax, flax, optax, orbax and chex already, nothing:
#   PY=python3 benchmarks/gpu_check.sh [--json PATH]   # runs from the source tree (PYTHONPATH)
#
# JSON: --json PATH, else $OUT/gpu_check.json where $OUT is set, else gpu_check.json in
# ${TMPDIR:-/tmp}. Refuses to run without an accelerator (these sizes would take hours on a
# CPU) unless --toy: the same commands at toy size on any device, which tests/test_bench.py runs
# on the CPU so that this script cannot rot.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
TOY=0
JSON=""
while [ $# -gt 0 ]; do
  case "$1" in
    --toy) TOY=1 ;;
    --json) JSON="$2"; shift ;;
    *) echo "usage: $0 [--toy] [--json PATH]" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$JSON" ] || JSON="${OUT:-${TMPDIR:-/tmp}}/gpu_check.json"
PARTS=$(mktemp -d)
trap 'rm -rf "$PARTS"' EXIT

if [ "$TOY" = 1 ]; then
  SHAPE=(--width 16 --depth 1 --heads 2 --batch 2 --seq-len 16 --vocab 16 --matmul 64x64x64)
  ATTN=2x2x16x8
  TIMING=(--steps 1 --warmup 1)
  STUDY=(--steps 1 --warmup 1 --set model.width=16 model.heads=2 model.depth=1
    data.batch_size=8 data.seq_len=40 data.eval_batches=0)  # 8: the tests' 8 CPU devices; 40: 19 bijection pairs
  LIMIT_STEP=300 LIMIT_STUDY=300
  DESC="toy size (--toy)"
else
  SHAPE=(--width 2048 --depth 8 --heads 16 --batch 8 --seq-len 1024 --matmul 8192x8192x8192)
  ATTN=8x16x1024x128
  TIMING=(--steps 5 --warmup 2)
  STUDY=(--steps 8 --warmup 3)
  LIMIT_STEP=270 LIMIT_STUDY=170
  DESC="width 2048, 8 blocks, 16 heads, 8 x 1024 tokens, n = 4, bf16 compute"
fi

"$PY" - "$TOY" <<'PYEOF' || exit 2
import sys

import jax

d = jax.devices()[0]
if d.platform == "cpu" and sys.argv[1] != "1":
  sys.exit(
    f"error: no accelerator visible to jax (devices: {jax.devices()}); "
    "pip install -e '.[cuda13]' (or '.[cuda12]'; launch/README.md)"
  )
print(f"device: {d.device_kind} x {jax.device_count()}, jax {jax.__version__}")
PYEOF

echo "== train step, $DESC"
timeout "$LIMIT_STEP" "$PY" benchmarks/step_bench.py "${SHAPE[@]}" --n 4 \
  --mixers residual,hc,mhc,mhc_lite --variants bf16 --all-variants "${TIMING[@]}" \
  --matmul-dtype bfloat16 --attention "$ATTN" --json "$PARTS/step_bench.json" \
  || echo "step_bench: stopped (rc $?)"
echo "== studies: GPU-sized variants, the costliest run of each for a few steps"
timeout "$LIMIT_STUDY" "$PY" benchmarks/study_cost.py "${STUDY[@]}" --json "$PARTS/studies.json" \
  || echo "study_cost: stopped (rc $?)"

"$PY" - "$PARTS" "$JSON" <<'PYEOF'
import json
import sys
from pathlib import Path

parts, out = Path(sys.argv[1]), Path(sys.argv[2])
report = {}
for name in ("step_bench", "studies"):
  p = parts / f"{name}.json"
  report[name] = json.loads(p.read_text()) if p.exists() else None
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps(report, indent=1))
print(f"== JSON: {out}")
PYEOF
