#!/usr/bin/env bash
# On a GPU machine: the same benchmark with an earlier commit's code and this
# tree's, alternated in one lease (host speed moves between leases by a quarter).
# OLD is either a python/moe_a2a package (then both sides run this tree's
# compiled core: only Python changes differ) or a whole source tree (built
# apart, so core changes are compared too):
#
#   mkdir -p .ab-old && git archive REV python/moe_a2a | tar -x -C .ab-old   # here; carry .ab-old
#   tools/gpu/ab.sh .ab-old/python/moe_a2a [ROUNDS]
#   mkdir -p .ab-old && git archive REV | tar -x -C .ab-old                   # the whole tree
#   tools/gpu/ab.sh .ab-old [ROUNDS]
#
# BENCH is the command (default: `moe-a2a bench a2a --train --device cuda`,
# 30 iterations after 5), DTYPES the dispatch dtypes (default "bf16 fp8"; "-":
# the command's own, no --dispatch-dtype), NP its MPI ranks (default 1),
# NEW_ARGS flags for the new side only (an option old lacks, such as
# --fabric-rows rank), ROUNDS how many old/new pairs per dtype (default 2).
# Prints the tables' rows.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
case ${1:-} in -h | --help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
usage="usage: ab.sh OLD [ROUNDS] (OLD: a python/moe_a2a package or a source tree; see --help)"
[[ $# -ge 1 && $# -le 2 ]] || { echo "ab.sh: $usage" >&2; exit 2; }
if [[ -f $1/__init__.py && -f $1/autograd.py ]]; then
  MODE=python
elif [[ -f $1/pyproject.toml && -f $1/python/moe_a2a/autograd.py ]]; then
  MODE=tree
else
  echo "ab.sh: OLD: got '$1', which holds neither a moe_a2a package nor a moe-a2a source tree; expected a python/moe_a2a or a whole tree copied out of a commit" >&2
  exit 2
fi
OLD=$(cd "$1" && pwd)
ROUNDS=${2:-2}
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || { echo "ab.sh: ROUNDS: got '$ROUNDS'; expected a whole number >= 1" >&2; exit 2; }
NP=${NP:-1}
[[ $NP =~ ^[1-9][0-9]*$ ]] || { echo "ab.sh: NP: got '$NP'; expected a whole number >= 1" >&2; exit 2; }
BENCH=${BENCH:-python3 -m moe_a2a bench a2a --train --device cuda --iters 30 --warmup 5 --progress never}
OUT=${OUT:-$ROOT/out/gpu} "$ROOT/tools/gpu/run_cuda_tests.sh" build | grep -a "^== build" || exit 1
[[ -d $ROOT/.whl ]] && export PYTHONPATH=/tmp/site
BASE_PATH=${PYTHONPATH:-}
export PYTHONPATH=$BASE_PATH
OLD_SITE=/tmp/ab-old-site
if [[ $MODE == tree ]]; then
  rm -rf "$OLD_SITE"
  LIBFABRIC_ROOT=$ROOT/.fabric-dev/root/usr timeout 300 python3 -m pip install -q --no-build-isolation --no-deps \
    --target "$OLD_SITE" "$OLD" >"$OLD_SITE.log" 2>&1 || { tail -20 "$OLD_SITE.log"; echo "ab.sh: building OLD failed" >&2; exit 1; }
  echo "== build old: ok"
fi
cd /tmp || exit 1
PKG=$(python3 -c "import moe_a2a, os; print(os.path.dirname(moe_a2a.__file__))")
NEW=/tmp/ab-new
copy_py() { (cd "$1" && find . -name '*.py' -exec cp --parents {} "$2" \;); }  # fresh mtimes: no stale .pyc
rm -rf "$NEW" && mkdir -p "$NEW" && copy_py "$PKG" "$NEW"
use() {  # old or new
  if [[ $MODE == python ]]; then
    if [[ $1 == old ]]; then copy_py "$OLD" "$PKG"; else copy_py "$NEW" "$PKG"; fi
  elif [[ $1 == old ]]; then
    export PYTHONPATH=$OLD_SITE${BASE_PATH:+:$BASE_PATH}
  else
    export PYTHONPATH=$BASE_PATH
  fi
}
for dtype in ${DTYPES:-bf16 fp8}; do
  for ((i = 0; i < ROUNDS; i++)); do
    for side in old new; do
      use $side
      echo "== $dtype $side"
      extra=()
      [[ $dtype != - ]] && extra=(--dispatch-dtype "$dtype")
      # NEW_ARGS and BENCH are split into words on purpose.
      # shellcheck disable=SC2206
      [[ $side == new ]] && extra+=(${NEW_ARGS:-})
      # shellcheck disable=SC2086
      mpirun --allow-run-as-root --oversubscribe -n "$NP" -x PYTHONPATH $BENCH "${extra[@]}" 2>&1 |
        grep -a "^| \|agreement"
    done
  done
done
use new
