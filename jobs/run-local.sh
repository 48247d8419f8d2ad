#!/usr/bin/env bash
# Run a moe-a2a MoE layer job on this host: mpirun with N ranks, a fabric preset,
# decode, prefill or train. See docs/running.md.
set -euo pipefail

MOE_PROG=run-local.sh
MOE_A2A_HOME=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source-path=SCRIPTDIR/.. source=jobs/lib.sh
source "$MOE_A2A_HOME/jobs/lib.sh"

usage() {
  cat <<EOF
Usage: jobs/run-local.sh [options] [-- more 'moe-a2a run' arguments]

Runs 'moe-a2a run' under mpirun on this host, with the fabric settings of a
preset exported to every rank.

Options:
  -n, --ranks N           MPI ranks (default 2)
  -p, --preset NAME       fabric preset (default tcp):
$(moe_preset_help "                            ")
  -m, --mode MODE         decode, prefill or train (default decode)
      --provider NAME     libfabric provider: ${MOE_PROVIDERS[*]} (default: the preset's)
      --model NAME        ${MOE_MODELS[*]} (default tiny)
      --iters N           measured iterations (default: the CLI's)
      --warmup N          warm-up iterations (default: the CLI's)
      --trace PATH        write an HDF5 trace of the run
      --verify            check every iteration against a single-process reference
      --ranks-per-node N  group consecutive ranks into virtual nodes of N ranks, so
                          one host exercises the cross-node path too
      --device DEVICE     cpu or cuda (default: cpu, the CLI's; pass cuda on a GPU host)
      --dry-run           print the exact command and exit
  -h, --help              this help

Environment:
  MOE_A2A_PYTHON          Python interpreter to run moe_a2a.cli with; else
                          $MOE_A2A_HOME/.venv/bin/python if it exists; else moe-a2a on PATH
  MOE_A2A_MPIRUN          the mpirun to use (default mpirun)
  MOE_A2A_TCP_IFACE       tcp preset: network interface (default lo on one host)
  Variables a preset sets keep the value they already have in your environment.

Example:
  jobs/run-local.sh -n 2 --preset tcp --mode decode --model tiny --iters 3
EOF
}

ranks=2
preset=tcp
mode=decode
provider=""
model=tiny
iters=""
warmup=""
trace=""
verify=0
ranks_per_node=""
device=""
dry_run=0
extra=()

while (($#)); do
  case $1 in
    --*=*)
      # --option=value: split and handle as "--option value".
      set -- "${1%%=*}" "${1#*=}" "${@:2}"
      continue
      ;;
    -n | --ranks) moe_need_value "$1" $#; ranks=$2; shift 2 ;;
    -p | --preset) moe_need_value "$1" $#; preset=$2; shift 2 ;;
    -m | --mode) moe_need_value "$1" $#; mode=$2; shift 2 ;;
    --provider) moe_need_value "$1" $#; provider=$2; shift 2 ;;
    --model) moe_need_value "$1" $#; model=$2; shift 2 ;;
    --iters) moe_need_value "$1" $#; iters=$2; shift 2 ;;
    --warmup) moe_need_value "$1" $#; warmup=$2; shift 2 ;;
    --trace)
      moe_need_value "$1" $#
      [[ -n $2 ]] || moe_die "--trace: got ''; expected a file path"
      trace=$2
      shift 2
      ;;
    --verify) verify=1; shift ;;
    --ranks-per-node) moe_need_value "$1" $#; ranks_per_node=$2; shift 2 ;;
    --device) moe_need_value "$1" $#; device=$2; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    *) moe_die "unknown argument '$1' (see --help; pass 'moe-a2a run' arguments after --)" ;;
  esac
done

moe_check_int --ranks "$ranks" 1
moe_check_choice --mode "$mode" "${MOE_MODES[@]}"
moe_check_choice --model "$model" "${MOE_MODELS[@]}"
[[ -z $iters ]] || moe_check_int --iters "$iters" 1
[[ -z $warmup ]] || moe_check_int --warmup "$warmup" 0
[[ -z $ranks_per_node ]] || moe_check_int --ranks-per-node "$ranks_per_node" 1
[[ -z $device ]] || moe_check_choice --device "$device" "${MOE_DEVICES[@]}"

# One host: single-host defaults of the preset (tcp binds the loopback).
moe_load_preset "$preset" 1
provider=${provider:-$PRESET_PROVIDER}
moe_check_choice --provider "$provider" "${MOE_PROVIDERS[@]}"
moe_fabric_env "$provider"
moe_resolve_cli "$dry_run"

mpirun=${MOE_A2A_MPIRUN:-mpirun}
mpirun_flags=()
mpirun_version=""
if command -v "$mpirun" >/dev/null; then
  mpirun_version=$("$mpirun" --version 2>&1 || true)
fi
if [[ $mpirun_version == *"Open MPI"* || $mpirun_version == *OpenRTE* ]]; then
  # Open MPI refuses root without --allow-run-as-root and more ranks than cores
  # without --oversubscribe (both flags work on 4.1 and 5). --bind-to none: every
  # rank runs a transfer-engine thread next to Python; pinning a rank to one core
  # would make the two share it.
  mpirun_flags=(--allow-run-as-root --oversubscribe --bind-to none)
elif [[ -z $mpirun_version ]]; then
  if ((dry_run)); then
    moe_warn "$mpirun: not found; showing the command for Open MPI"
    mpirun_flags=(--allow-run-as-root --oversubscribe --bind-to none)
  else
    moe_die "$mpirun: not found (install Open MPI, e.g. apt-get install openmpi-bin, or set MOE_A2A_MPIRUN)"
  fi
fi
# Other MPIs (MPICH, Intel MPI): their mpirun takes -n and neither binds by
# default nor refuses root, so no extra flags.

run_args=(run --mode "$mode" --model "$model" --provider "$provider")
[[ -z $iters ]] || run_args+=(--iters "$iters")
[[ -z $warmup ]] || run_args+=(--warmup "$warmup")
[[ -z $trace ]] || run_args+=(--trace "$trace")
((verify == 0)) || run_args+=(--verify)
[[ -z $ranks_per_node ]] || run_args+=(--ranks-per-node "$ranks_per_node")
[[ -z $device ]] || run_args+=(--device "$device")

if ((!dry_run)) && [[ -n $trace ]]; then
  mkdir -p -- "$(dirname -- "$trace")"
fi

moe_launch "$dry_run" env "${MOE_ENV[@]}" "$mpirun" "${mpirun_flags[@]}" -n "$ranks" \
  "${MOE_CLI[@]}" "${run_args[@]}" "${extra[@]}"
