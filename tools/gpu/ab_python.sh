#!/usr/bin/env bash
# On a GPU machine: the same benchmark with an earlier commit's Python and this
# tree's, alternated in one lease (host speed moves between leases by a quarter).
# The compiled core is this tree's for both, so only Python changes may differ.
#
#   mkdir -p .ab-old && git archive REV python/moe_a2a | tar -x -C .ab-old   # here; carry .ab-old
#   tools/gpu/ab_python.sh .ab-old/python/moe_a2a [ROUNDS]
#
# BENCH is the command (default: `moe-a2a bench a2a --train --device cuda`,
# 30 iterations after 5), DTYPES the dispatch dtypes (default "bf16 fp8"),
# ROUNDS how many old/new pairs per dtype (default 2).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
case ${1:-} in -h | --help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
usage="usage: ab_python.sh OLD_PACKAGE_DIR [ROUNDS] (see --help)"
[[ $# -ge 1 && $# -le 2 ]] || { echo "ab_python.sh: $usage" >&2; exit 2; }
if [[ ! -f $1/__init__.py || ! -f $1/autograd.py ]]; then
  echo "ab_python.sh: OLD_PACKAGE_DIR: got '$1', which holds no moe_a2a package; expected a python/moe_a2a copied out of a commit" >&2
  exit 2
fi
OLD=$(cd "$1" && pwd)
ROUNDS=${2:-2}
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || { echo "ab_python.sh: ROUNDS: got '$ROUNDS'; expected a whole number >= 1" >&2; exit 2; }
BENCH=${BENCH:-python3 -m moe_a2a bench a2a --train --device cuda --iters 30 --warmup 5 --progress never}
OUT=${OUT:-$ROOT/out/gpu} "$ROOT/tools/gpu/run_cuda_tests.sh" build | grep -a "^== build" || exit 1
[[ -d $ROOT/.whl ]] && export PYTHONPATH=/tmp/site
cd /tmp || exit 1
PKG=$(python3 -c "import moe_a2a, os; print(os.path.dirname(moe_a2a.__file__))")
NEW=/tmp/ab-new
copy_py() { (cd "$1" && find . -name '*.py' -exec cp --parents {} "$2" \;); }  # fresh mtimes: no stale .pyc
rm -rf "$NEW" && mkdir -p "$NEW" && copy_py "$PKG" "$NEW"
use() { copy_py "$1" "$PKG"; }
for dtype in ${DTYPES:-bf16 fp8}; do
  for ((i = 0; i < ROUNDS; i++)); do
    for side in old new; do
      if [[ $side == old ]]; then use "$OLD"; else use "$NEW"; fi
      echo "== $dtype $side"
      # BENCH is split into words on purpose.
      # shellcheck disable=SC2086
      mpirun --allow-run-as-root -n 1 $BENCH --dispatch-dtype "$dtype" 2>&1 | grep -a "^| f\|^| b\|agreement"
    done
  done
done
use "$NEW"
