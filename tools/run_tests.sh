#!/usr/bin/env bash
# The whole test suite: lint, unit tests, then the multi-rank tests under
# mpirun for each provider and world size. Only rank 0 writes to the console;
# the other ranks' output goes to per-rank logs, shown when a run fails.
# Ends with one line that sums every pytest run.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
LOGS=${MOE_A2A_TEST_LOGS:-$ROOT/out/test-logs}
rm -rf "$LOGS" && mkdir -p "$LOGS"
MPIRUN=(mpirun --allow-run-as-root --oversubscribe)
status=0
FAILURES=()  # one line per failed step, repeated in the summary (CI shows the end of the output)
fail() { status=1; FAILURES+=("$1"); }

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "ruff"
ruff check python tests || fail "ruff"

step "mypy (python/moe_a2a, configured in pyproject.toml)"
mypy || fail "mypy"

# The training tests skip where TorchTitan is absent; here it must be present and import.
step "TorchTitan imports (the training tests' reference)"
python -c "import torchtitan.models.common.token_dispatcher, triton; print('torchtitan and triton', triton.__version__)" \
  || fail "TorchTitan does not import"

# One process each: unit tests, and the protocol's N ranks as threads on the in-memory fabric.
step "unit tests and the protocol in one process"
python -m pytest -q -rs -p no:cacheprovider tests/unit tests/protocol --junitxml="$LOGS/unit.xml" \
  || fail "unit tests and the protocol in one process"

# Each test starts a job of its own (mpirun or torchrun) and checks how it ends.
step "job tests (each its own mpirun or torchrun job)"
python -m pytest -q -rs -p no:cacheprovider tests/jobs --junitxml="$LOGS/jobs.xml" || fail "job tests"

# Emulated hosts in network namespaces (tools/testbed.py); they skip, saying why, where namespaces are not allowed.
step "testbed tests (ranks on emulated hosts, two NICs each)"
python -m pytest -q -rs -p no:cacheprovider tests/testbed --junitxml="$LOGS/testbed.xml" || fail "testbed tests"

step "CUDA tests (they run where a GPU is; here they print why they are skipped)"
python -m pytest -q -rs -p no:cacheprovider tests/cuda --junitxml="$LOGS/cuda.xml" || fail "CUDA tests"

# provider:world sizes for the multi-rank suites
MATRIX=("tcp:1 2 3 4 8" "shm:1 2 3 4 8")
for entry in "${MATRIX[@]}"; do
  provider=${entry%%:*}
  for n in ${entry#*:}; do
    step "multi-rank tests: provider=$provider ranks=$n"
    run="$LOGS/$provider-n$n"
    mkdir -p "$run"
    rm -f "$run"/rank*.abort.log  # an earlier run's (tests/conftest.py writes one where a test aborts the job)
    if ! MOE_A2A_TEST_PROVIDER=$provider MOE_A2A_RANK_LOGS=$run timeout 1500 \
        "${MPIRUN[@]}" -n "$n" "$ROOT/tools/rank0_console.sh" \
        python -m pytest -q -rs -p no:cacheprovider --with-mpi tests/mpi --junitxml="$run/junit.xml"; then
      # A timed-out rank's log ends with its own stacks, then those of the
      # other ranks on the host (tests/conftest.py): keep room for them.
      for f in "$run"/rank*.log; do
        [[ -e $f ]] || continue
        echo "---- $f (last 300 lines)"
        tail -n 300 "$f"
      done
      # The test that stopped the job, as tests/conftest.py announces it on the failing rank.
      first=$(grep -ahm1 -o "=== moe-a2a: rank .* FAILED during .*" "$run"/rank*.log | head -1)
      # and its error's first line, from the same rank's log (CI shows only the end of the output)
      why=
      if [[ -n $first ]]; then
        log=$(grep -alF "$first" "$run"/rank*.log | head -1)
        why=$(grep -am1 "^E  " "$log" | sed 's/^E  *//')
      fi
      fail "multi-rank provider=$provider ranks=$n: ${first:-no test reported a failure (see the rank logs above)}${why:+ -- $why}"
    fi
  done
done

step "summary"
python "$ROOT/tools/sum_junit.py" "$LOGS" || status=1
for line in "${FAILURES[@]}"; do echo "FAILED: $line"; done
exit $status
