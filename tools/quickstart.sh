#!/usr/bin/env bash
# Sets up a fresh Debian 12/13 machine (as root) and runs moe-a2a.
#   tools/quickstart.sh run    set up, then run the main job (tiny MoE decode layer on 4 ranks)
#   tools/quickstart.sh test   set up, then run the whole test suite
#   tools/quickstart.sh setup  set up only
# Idempotent: a second run reuses the packages, the virtualenv and the build.
set -euo pipefail

usage() { sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; }

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV="$ROOT/.venv"
TORCH_VERSION=2.13.0
APT_PACKAGES=(libfabric-dev libfabric-bin libopenmpi-dev openmpi-bin pkg-config cmake ninja-build g++ shellcheck)
PIP_PACKAGES=(numpy mpi4py h5py tabulate tqdm matplotlib pytest pytest-mpi pytest-timeout ruff mypy pyyaml jsonschema
              "scikit-build-core>=0.11" "nanobind>=2.0")
# The training tests' reference: TorchTitan's own MoE and token dispatchers. TorchTitan
# imports triton at import time; triton's wheel imports on a machine without a GPU.
# tokenizers and datasets (TorchTitan's own dependencies, named because the trainer test
# builds its tokenizer and reads its text with them).
TRAIN_PACKAGES=(torchtitan==0.3.0 triton tokenizers datasets)

log() { printf '\033[1m[quickstart]\033[0m %s\n' "$*" >&2; }

setup_system() {
  local missing=()
  for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    log "installing system packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

setup_python() {
  if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating $VENV"
    python3 -m venv "$VENV" || { apt-get install -y -qq python3-venv >/dev/null && python3 -m venv "$VENV"; }
  fi
  local py="$VENV/bin/python"
  # torch first and pinned: it takes the CPU wheel from local disk instead of downloading a CUDA build.
  if ! "$py" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
    log "installing torch==$TORCH_VERSION"
    "$py" -m pip install -q --upgrade pip
    "$py" -m pip install -q "torch==$TORCH_VERSION"
  fi
  if ! "$py" -c "import mpi4py, h5py, tabulate, tqdm, matplotlib, pytest, pytest_mpi, pytest_timeout, yaml, jsonschema, nanobind, scikit_build_core, mypy" 2>/dev/null; then
    log "installing Python packages"
    "$py" -m pip install -q "${PIP_PACKAGES[@]}"
  fi
  if ! "$py" -c "import torchtitan.models.common.token_dispatcher, tokenizers, datasets" 2>/dev/null; then
    log "installing TorchTitan 0.3.0 (the training tests' reference)"
    # torch named too, so nothing TorchTitan needs replaces the pinned CPU build.
    "$py" -m pip install -q "torch==$TORCH_VERSION" "${TRAIN_PACKAGES[@]}"
  fi
  log "building moe-a2a (C++ core, CUDA kernels where nvcc exists, Python module)"
  (cd "$ROOT" && "$py" -m pip install -q --no-build-isolation --no-deps -e .)
}

main() {
  local what=${1:-}
  case "$what" in
    run | test | setup) ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; echo "quickstart: expected run, test or setup; got '${what}'" >&2; exit 2 ;;
  esac
  setup_system
  setup_python
  export PATH="$VENV/bin:$PATH"
  case "$what" in
    run) exec "$ROOT/tools/main_job.sh" ;;
    test) exec "$ROOT/tools/run_tests.sh" ;;
    setup) log "ready: source $VENV/bin/activate" ;;
  esac
}

main "$@"
