#!/usr/bin/env bash
# Device check for one 10-minute accelerator slot: the studies' GPU-sized variants, briefly, with
# their cost per step and projected study cost (benchmarks/study_cost.py), then the train step at
# a GPU size for residual and mhc (benchmarks/step_bench.py: mhc overhead over residual, model
# FLOPs utilisation against the device's own matmul rate). Prints everything; writes nothing in
# the repository.
#
#   pip install -e '.[cuda]'       # once, on the GPU machine (jax's CUDA 12 plugin)
#   benchmarks/gpu_check.sh        # about 8 minutes on one H100/H200-class GPU
#
# Refuses to run without an accelerator (the same sizes on a CPU would take hours).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'PYEOF' || exit 2
import jax, sys
d = jax.devices()[0]
if d.platform == "cpu":
    sys.exit("error: no accelerator visible to jax (devices: %s); pip install -e '.[cuda]'" % jax.devices())
print(f"device: {d.device_kind} x {jax.device_count()}, jax {jax.__version__}")
PYEOF
echo "== studies: GPU-sized variants, 10 timed steps of the costliest run each"
timeout 400 "$PY" benchmarks/study_cost.py --steps 10 --warmup 3 || echo "study_cost: stopped (rc $?)"
echo "== train step, width 2048, 8 blocks, 8 x 1024 tokens, n = 4 streams (float32 and bfloat16)"
timeout 150 "$PY" benchmarks/step_bench.py --mixers residual,mhc --width 2048 --depth 8 --heads 16 \
  --batch 8 --seq-len 1024 --variants scan,bf16 --steps 5 --warmup 2 --matmul 8192x8192x8192 \
  || echo "step_bench: stopped (rc $?)"  # a reference matmul big enough to reach a GPU's rate
