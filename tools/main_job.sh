#!/usr/bin/env bash
# The main job: a tiny MoE decode layer on 4 ranks over the tcp provider,
# checked against a single-process reference, with an HDF5 trace and its
# summary. Expects the environment of tools/quickstart.sh.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${MOE_A2A_OUT:-$ROOT/out}
mkdir -p "$OUT"
TRACE="$OUT/decode-tiny.h5"
mpirun -n 4 --allow-run-as-root --oversubscribe \
  moe-a2a run --mode decode --model tiny --iters 20 --warmup 3 --verify --provider tcp --ranks-per-node 2 \
  --trace "$TRACE"
moe-a2a trace summary "$TRACE"
