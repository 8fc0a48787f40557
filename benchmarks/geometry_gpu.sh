#!/usr/bin/env bash
# The formation study on one lent accelerator call (10 minutes, about 8 of them working): issue
# 55 item 2's setting (configs/studies/geometry_formation.yaml: the authors' bijection wind
# tunnel at their size, 6 blocks, d = 192, 6 heads, ~2.67M parameters, batch 256, AdamW 3e-4,
# warm-up 2000, a checkpoint every 50) for residual, hc and mhc (n = 4 streams), seeds 0, 1, 2,
# each arm's seeds one vmapped population, to as many steps as fit, then the checkpoint series
# (`mhc-jax eval --series`'s rows: frame statistic and its null, entropy MAE, key orthogonality
# per head, gated M) of every run at the study's steps 100, 200, 300, 400, 500, 750, 1000, 1500,
# 2000, 2500 that it reached, and at 0 (the random-init control). Writes nothing in the
# repository; the engine and its sizing arithmetic are benchmarks/geometry_gpu.py.
#
#   PY=python3 benchmarks/geometry_gpu.sh [--out DIR] [--budget-s 480] [--steps N] [--toy]
#
# How it sizes itself (no GPU has run it yet): it first trains each arm from step 0 to step 150
# (its step time is the wall time between the checkpoints at 50 and 150, checkpoints included,
# compile excluded) and reads three rows of its series (timed: a run's fixed cost, one row's),
# then picks the most steps, a multiple of 50 up to 2500, whose training of every arm and series
# of every run fit what is left of --budget-s (seconds for the whole script, default 480), and
# trains each arm on from where it stopped. Every run keeps the study's 2500-step config
# (warm-up 2000, constant after) and is stopped at that step, so it is the study's run up to
# there (a few steps past it: the stop lands on the step the trainer is at; the series reads
# N). Training and series stop at deadlines if the measurement was optimistic; what exists is
# written. --steps N trains to N instead (still measured and sized; the JSON says both).
#
# Estimated, not measured (until the first lent call replaces it with geometry_gpu.json):
#   FLOPs (the sweep's --dry-run, 6 N per token + attention): 413 T a residual run of 2500 steps
#   of 256 x 39 tokens (hc 415 T, mhc 446 T, with n = 4 streams' extra parameters), so one step
#   of a 3-seed population is 5.0e11 (mhc 5.4e11) and all 9 runs to 2500 are 3.8e15. At the
#   ~40-60 TFLOP/s an H100 may reach on these d = 192 matmuls in float32 (XLA's default matmul
#   precision on the GPU, which may use TF32; the CPU study's is full float32), that is ~10 ms
#   a population step; per-step overhead (kernel launches of 6 blocks, twice for remat, under a
#   vmap; hc/mhc's stream mixing, mhc's Sinkhorn iterations; the async checkpoint every 50
#   steps) likely dominates: ~15-30 ms residual, ~20-40 ms hc, ~30-60 ms mhc. Compiling each
#   arm's step and its series functions, ~35-75 s an arm, is the largest cost: with the
#   measurement it takes ~150-300 of the 480 s. The series: ~1-2 s a row (16 sequences x ~740
#   Jacobian rows on the GPU, the permutation nulls on the host), up to 11 rows a run. So with
#   the default 480 s, by choose_steps' own arithmetic: 1200 steps per arm at 20/30/45 ms
#   steps, 1.5 s rows and 50 s of compiles an arm; 450 at 25/35/50 ms, 2 s, 75 s; 2400 at
#   15/25/35 ms, 1 s, 35 s; none past the measurement's 150 when compiles pass ~100 s an arm
#   (it then says so, exit 1, with the measured costs and the rows read). Likely: ~500-1200
#   steps per arm, the series to step 500-1000. The study's decision reads 1000-2500: one call
#   is a partial read; a longer lease (--budget-s) or a second call goes further.
#   What a researcher gets: the frame statistic and MAE curves of hc and mhc beside residual's,
#   3 seeds each, through the window where the authors' geometry forms (their 2.26x at step
#   300, 3.65x at 400, 5.45x at 1000) as far as the steps reached, and the measured step and
#   series costs that size the next call.
#
# Output ($OUT, else --out DIR): geometry_gpu.json (device, each arm's measured step time and
# series costs, the sizing, the steps each run reached, the rows read), runs.csv (every run's
# rows: arm, seed, step, the series' columns), decision.csv and formation.png (the study's
# analysis, read as far as the steps go: `pending` where 2500 was not reached),
# runs/<arm>/seed=<s>/ (config.yaml, metrics.jsonl, events.jsonl, summary.json,
# geometry_series.csv), sweeps/<arm>.yaml (the sweep file each arm ran). Read it with
#   python docs/studies/geometry_formation/analysis.py "$OUT/runs.csv"   # decision, figure
#
# Refuses to run without an accelerator (one error: line, exit 2) unless --toy: the same
# commands at toy size on any device (width 16, 1 block, 4 pairs of 5 symbols, batch 8, up to
# 30 steps, a checkpoint every 5), which tests/test_geometry_gpu.py runs on the CPU so that this
# script cannot rot.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
ARGS=()
DIR=${OUT:-}
while [ $# -gt 0 ]; do
  case "$1" in
    --toy) ARGS+=(--toy) ;;
    --out) DIR="$2"; shift ;;
    --budget-s|--steps) ARGS+=("$1" "$2"); shift ;;
    *) echo "usage: $0 [--toy] [--out DIR] [--budget-s S] [--steps N]" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$DIR" ] || { echo "error: no output folder: set \$OUT or pass --out DIR" >&2; exit 2; }
WORK=$(mktemp -d "${TMPDIR:-/tmp}/geometry_gpu.XXXXXX")  # the sweeps and their checkpoints
trap 'rm -rf "$WORK"' EXIT
# one compile of each program per process: the runs of an arm share theirs
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$WORK/xla_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0.2}
"$PY" benchmarks/geometry_gpu.py --out "$DIR" --work "$WORK" "${ARGS[@]}"
