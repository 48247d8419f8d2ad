#!/usr/bin/env bash
# On a GPU machine: build moe-a2a, run the CUDA tests (kernels in one process,
# then the multi-rank suite tests/mpi/test_a2a.py, test_reliability.py,
# test_overlap.py and test_rank_rows_cuda.py on device cuda with 1, 2, 4
# and 8 MPI ranks sharing the GPU, with and without virtual nodes; the training
# tests, tests/mpi/test_autograd.py, test_cached_routing.py, test_torchtitan.py and test_compile.py, at 1, 2 and 4 ranks),
# then the CUDA benchmark at 1, 2, 4 and 8 ranks. Prints a short
# summary last; full logs go to $OUT (or out/gpu). The stage gpudirect (not in
# the default set) runs the multi-rank and training suites again with every
# call of a layout with fabric peers GPU-direct (MOE_A2A_GPU_DIRECT_SHM_MIN_BYTES=0):
# build it against a libfabric with CUDA support (LIBFABRIC_ROOT, below).
#
# Needs libfabric's headers where only its runtime is installed: carry them in
# .fabric-dev (see docs/cuda.md), and pytest-mpi, torchtitan==0.3.0, spmd_types,
# tyro, docstring-parser and typeguard as wheels in .whl. LIBFABRIC_ROOT, where
# set, names another libfabric to build against (one with CUDA support for
# GPU-direct; its lib then goes on LD_LIBRARY_PATH).
#
#   tools/gpu/run_cuda_tests.sh [stages...]   stages: build kernels multirank training bench gpudirect peerloss
#   (default: all but gpudirect; peerloss SIGKILLs ranks of its own jobs: tests/jobs/test_peer_loss.py)
# MR_SIZES and BENCH_SIZES choose the world sizes (default "1 2 4 8"; gpudirect "2 4 8"); TRAIN_SIZES (default "1 2 4").
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 1
# Help before anything is made or run.
case ${1:-} in -h | --help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
for stage in "$@"; do
  case $stage in
    build | kernels | multirank | training | bench | gpudirect | peerloss) ;;
    *) echo "run_cuda_tests.sh: unknown stage '$stage'; expected any of: build kernels multirank training bench gpudirect peerloss (see --help)" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-$ROOT/out/gpu}
mkdir -p "$OUT"
STAGES=${*:-build kernels multirank training bench peerloss}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export MOE_A2A_TEST_PROVIDER=${MOE_A2A_TEST_PROVIDER:-shm} FI_TCP_IFACE=lo
PY=${PYTHON:-python3}
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
SUMMARY=()
note() { SUMMARY+=("$1"); echo "== $1"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }

has build && { nvidia-smi -L; df -h /dev/shm | tail -1; nproc; }

if [[ -d .whl ]]; then  # pytest-mpi and TorchTitan, missing on the GPU image
  [[ -d /tmp/site ]] || $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi

if has build; then
  start=$SECONDS
  if LIBFABRIC_ROOT=${LIBFABRIC_ROOT:-$ROOT/.fabric-dev/root/usr} timeout 300 "$PY" -m pip install --no-build-isolation --no-deps . \
      >"$OUT/build.log" 2>&1; then
    note "build: ok in $((SECONDS - start)) s"
  else
    tail -40 "$OUT/build.log"
    note "build: FAILED (see build.log)"
    printf '%s\n' "${SUMMARY[@]}"
    exit 1
  fi
fi
cd /tmp || exit 1  # import the installed package, not the source tree
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$ROOT/tests/cuda

if has kernels; then
  timeout 480 "$PY" -m pytest -q -rs -p no:cacheprovider "$ROOT/tests/cuda/test_kernels.py" \
    "$ROOT/tests/cuda/test_rank_rows.py" \
    --junitxml="$OUT/kernels.xml" 2>&1 | tee "$OUT/kernels.log" | tail -25
  note "kernel tests: $(grep -aE "(passed|failed|error)" "$OUT/kernels.log" | tail -1)"
fi

# One multi-rank run: multirank N LABEL [VAR=VALUE...] (extra environment for the ranks);
# MR_TESTS names the test files (default tests/mpi/test_a2a.py, test_reliability.py, test_overlap.py,
# test_rank_rows_cuda.py and test_gpu_direct.py, which skips saying why unless the provider registers
# CUDA memory).
multirank() {
  local n=$1 label=$2 logs="$OUT/mr-n$1${2// /-}"
  shift 2
  local tests
  local all="$ROOT/tests/mpi/test_a2a.py $ROOT/tests/mpi/test_reliability.py $ROOT/tests/mpi/test_overlap.py"
  read -ra tests <<<"${MR_TESTS:-$all $ROOT/tests/mpi/test_rank_rows_cuda.py $ROOT/tests/mpi/test_gpu_direct.py}"
  mkdir -p "$logs"
  MOE_A2A_RANK_LOGS=$logs timeout "${MR_TIMEOUT:-300}" "${MPIRUN[@]}" -n "$n" "$ROOT/tools/rank0_console.sh" \
    env MOE_A2A_TEST_DEVICE=cuda "$@" "$PY" -m pytest -q -rs -p no:cacheprovider --with-mpi "${tests[@]}" \
    --junitxml="$logs/junit.xml" >"$logs/rank0.log" 2>&1
  local rc=$?
  grep -av "^\[" "$logs/rank0.log" | tail -15
  # pytest's last line, else (a timeout, an abort) the exit status and every rank's first error line.
  local result
  result=$(grep -ahE "(passed|failed|error).* in [0-9.]+s" "$logs/rank0.log" | tail -1)
  if [[ -z $result ]]; then
    local first
    first=$(grep -ahm1 -E "^E |Error|Timeout" "$logs"/rank*.log | head -3 | tr '\n' ' ' | cut -c1-300)
    result="no pytest summary (exit $rc$([[ $rc == 124 ]] && echo ": timed out after ${MR_TIMEOUT:-300} s")); first errors: ${first:-none in the logs}"
  fi
  note "multirank n=$n$label (provider $MOE_A2A_TEST_PROVIDER): $result"
}

if has multirank; then
  for n in ${MR_SIZES:-1 2 4 8}; do multirank "$n" ""; done
  # Ranks sharing the GPU receive eagerly in two launches; force the one-launch
  # receive (a rank alone on its GPU) across ranks too.
  for n in ${MR_FUSED_SIZES:-4}; do multirank "$n" " fused-recv" MOE_A2A_CUDA_FUSED_RECV=1; done
fi

if has training; then
  for n in ${TRAIN_SIZES:-1 2 4}; do
    MR_TESTS="$ROOT/tests/mpi/test_autograd.py $ROOT/tests/mpi/test_cached_routing.py $ROOT/tests/mpi/test_torchtitan.py $ROOT/tests/mpi/test_compile.py" \
      multirank "$n" " training"
  done
fi

if has gpudirect; then
  # Every call GPU-direct where the provider registers CUDA memory; elsewhere the suite stages and
  # tests/mpi/test_gpu_direct.py says why it skipped.
  for n in ${MR_SIZES:-2 4 8}; do multirank "$n" " gpu-direct" MOE_A2A_GPU_DIRECT_SHM_MIN_BYTES=0; done
  MR_TESTS="$ROOT/tests/mpi/test_autograd.py $ROOT/tests/mpi/test_cached_routing.py $ROOT/tests/mpi/test_torchtitan.py" \
    multirank 2 " training gpu-direct" MOE_A2A_GPU_DIRECT_SHM_MIN_BYTES=0
fi

if has peerloss; then
  # Mask and continue, rejoin, and a graph captured before a loss (issue 32): four ranks on the GPU
  # started by the test itself (not mpirun: a dead rank would end the job), one SIGKILLed.
  MOE_A2A_TEST_DEVICE=cuda timeout "${PL_TIMEOUT:-480}" "$PY" -m pytest -q -rs -s -p no:cacheprovider \
    "$ROOT/tests/jobs/test_peer_loss.py" -k "survivors or replacements_rejoin or fails_late or graph_captured" \
    --junitxml="$OUT/peerloss.xml" >"$OUT/peerloss.log" 2>&1
  grep -aE "served with|rejoined \(" "$OUT/peerloss.log" | head -20
  note "peer loss (cuda): $(grep -aE "(passed|failed|error).* in [0-9.]+s" "$OUT/peerloss.log" | tail -1)"
fi

if has bench; then
  for n in ${BENCH_SIZES:-1 2 4 8}; do
    # BENCH_ARGS is split into words on purpose (extra flags).
    # shellcheck disable=SC2086
    timeout "${BENCH_TIMEOUT:-240}" "${MPIRUN[@]}" -n "$n" "$PY" -m moe_a2a.bench.a2a_cuda --shapes decode prefill --iters 10 \
      --provider "$MOE_A2A_TEST_PROVIDER" --json "$OUT/bench.jsonl" ${BENCH_ARGS:-} >"$OUT/bench-n$n.log" 2>&1
    note "bench n=$n: exit $?"
    # The configuration block, the table and its note (about 26 lines for two shapes).
    grep -v "^\[" "$OUT/bench-n$n.log" | tail -30
  done
fi

echo
echo "=== summary"
printf '%s\n' "${SUMMARY[@]}"
