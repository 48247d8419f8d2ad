#!/usr/bin/env bash
# The main job: a tiny MoE decode layer on 4 ranks over the tcp provider,
# checked against a single-process reference, with an HDF5 trace. Prints the
# command it runs, then the commands to look further, as they work in your shell.
# Expects the environment of tools/quickstart.sh.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${MOE_A2A_OUT:-$ROOT/out}
mkdir -p "$OUT"
TRACE="$OUT/decode-tiny.h5"
CMD=(mpirun -n 4 --allow-run-as-root --oversubscribe
  moe-a2a run --mode decode --model tiny --iters 20 --warmup 3 --verify --provider tcp --ranks-per-node 2
  --trace "$TRACE")
printf '$ %s\n' "${CMD[*]}"
"${CMD[@]}"
cat <<NEXT

next, in your shell:
  source $ROOT/.venv/bin/activate
  moe-a2a trace summary $TRACE
  moe-a2a trace plot $TRACE -o $OUT/plots
  mpirun -n 4 --allow-run-as-root --oversubscribe moe-a2a run --mode train --model tiny --verify
NEXT
