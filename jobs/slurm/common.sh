# shellcheck shell=bash
# The body of jobs/slurm/decode.sbatch and jobs/slurm/prefill.sbatch: one srun
# step that starts one rank per GPU on every node of the allocation. Sourced
# after jobs/lib.sh; the .sbatch files only differ in their #SBATCH lines and
# the mode they pass to moe_slurm_main. See docs/running.md.

# moe_slurm_usage MODE
moe_slurm_usage() {
  local mode=$1
  cat <<EOF
Usage: sbatch [sbatch options] jobs/slurm/$mode.sbatch [options] [-- more 'moe-a2a run' arguments]
       bash jobs/slurm/$mode.sbatch --dry-run [options]

Runs 'moe-a2a run --mode $mode' across the nodes of a Slurm allocation with
srun: one rank per GPU, every GPU of a node visible to every rank of that node
(CUDA IPC between them needs it; rank r uses GPU r mod GPUs-per-node), CPU
cores next to each rank's GPU, one HDF5 trace per job. Inside an allocation
(salloc, sbatch --wrap) the script can also be run with bash; the #SBATCH lines
then do not apply.

Options:
  -p, --preset NAME         fabric preset (default efa):
$(moe_preset_help "                              ")
      --provider NAME       libfabric provider: ${MOE_PROVIDERS[*]} (default: the preset's)
      --model NAME          ${MOE_MODELS[*]} (default deepseek-v3)
      --iters N             measured iterations (default: the CLI's)
      --warmup N            warm-up iterations (default: the CLI's)
      --verify              check every iteration against a single-process reference
      --trace PATH          HDF5 trace (default: \$MOE_A2A_TRACE_DIR/$mode-MODEL-JOBID.h5,
                            MOE_A2A_TRACE_DIR defaulting to <submit dir>/traces)
      --nodes N             nodes to use (default: the allocation's; 2 in a dry run
                            outside Slurm)
      --tasks-per-node N    ranks per node (default: GPUs per node, else the
                            allocation's tasks per node, else 8)
      --cpus-per-task N     CPUs per rank (default: the node's CPUs / ranks per node)
      --cpu                 CPU-only cluster: no GPU options, ranks run on CPU
      --srun-mpi TYPE       srun --mpi=TYPE (pmix, pmi2, ...; default \$MOE_A2A_SRUN_MPI,
                            else the site's default)
      --dry-run             print the exact command and exit (works outside Slurm)
  -h, --help                this help

Environment:
  MOE_A2A_HOME              repository root, when the job cannot find it (Slurm runs a
                            copy of this script; by default the submit directory is used)
  MOE_A2A_PYTHON            Python interpreter to run moe_a2a.cli with; else
                            <repo>/.venv/bin/python if it exists; else moe-a2a on PATH
  MOE_A2A_TRACE_DIR         directory of the default trace file
  MOE_A2A_TCP_IFACE         tcp preset: network interface (default: the default route's)
  MOE_A2A_IB_DEVICE, MOE_A2A_IB_IFACE   cx7 preset: RDMA device prefix, IP interface
  Variables a preset sets keep the value they already have in your environment.

Examples:
  sbatch jobs/slurm/$mode.sbatch --preset efa --iters 100 --verify
  sbatch --nodes=4 jobs/slurm/$mode.sbatch --preset cx7
  bash jobs/slurm/$mode.sbatch --dry-run --nodes 4 --preset efa
  sbatch -N 2 --ntasks-per-node=8 --wrap "bash jobs/slurm/$mode.sbatch --cpu --preset tcp --model tiny"
EOF
}

# moe_slurm_int NAME: the leading integer of a Slurm variable ("8(x2)" -> 8), or "".
moe_slurm_int() {
  local value=${!1:-}
  value=${value%%[!0-9]*}
  printf '%s\n' "$value"
}

# moe_slurm_main MODE ARG...: parse the options, build the srun command, print or run it.
moe_slurm_main() {
  local mode=$1
  shift
  local preset=efa provider="" model=deepseek-v3 iters="" warmup="" verify=0 trace=""
  local nodes="" tasks_per_node="" cpus_per_task="" cpu_only=0 srun_mpi=${MOE_A2A_SRUN_MPI:-}
  local dry_run=0
  local -a extra=()

  while (($#)); do
    case $1 in
      --*=*)
        # --option=value: split and handle as "--option value".
        set -- "${1%%=*}" "${1#*=}" "${@:2}"
        continue
        ;;
      -p | --preset) moe_need_value "$1" $#; preset=$2; shift 2 ;;
      --provider) moe_need_value "$1" $#; provider=$2; shift 2 ;;
      --model) moe_need_value "$1" $#; model=$2; shift 2 ;;
      --iters) moe_need_value "$1" $#; iters=$2; shift 2 ;;
      --warmup) moe_need_value "$1" $#; warmup=$2; shift 2 ;;
      --verify) verify=1; shift ;;
      --trace)
        moe_need_value "$1" $#
        [[ -n $2 ]] || moe_die "--trace: got ''; expected a file path"
        trace=$2
        shift 2
        ;;
      --nodes) moe_need_value "$1" $#; nodes=$2; shift 2 ;;
      --tasks-per-node) moe_need_value "$1" $#; tasks_per_node=$2; shift 2 ;;
      --cpus-per-task) moe_need_value "$1" $#; cpus_per_task=$2; shift 2 ;;
      --cpu) cpu_only=1; shift ;;
      --srun-mpi) moe_need_value "$1" $#; srun_mpi=$2; shift 2 ;;
      --dry-run) dry_run=1; shift ;;
      -h | --help) moe_slurm_usage "$mode"; exit 0 ;;
      --) shift; extra=("$@"); break ;;
      *) moe_die "unknown argument '$1' (see --help; pass 'moe-a2a run' arguments after --)" ;;
    esac
  done

  moe_check_choice --model "$model" "${MOE_MODELS[@]}"
  [[ -z $iters ]] || moe_check_int --iters "$iters" 1
  [[ -z $warmup ]] || moe_check_int --warmup "$warmup" 0
  [[ -z $srun_mpi || $srun_mpi =~ ^[A-Za-z0-9_]+$ ]] ||
    moe_die "--srun-mpi: got '$srun_mpi'; expected a Slurm MPI plugin name such as pmix or pmi2"

  local job_id=${SLURM_JOB_ID:-}
  if [[ -z $job_id ]]; then
    ((dry_run)) || moe_die "not inside a Slurm allocation (no SLURM_JOB_ID): submit with" \
      "'sbatch jobs/slurm/$mode.sbatch', run it inside salloc, or add --dry-run"
    job_id=dryrun
  fi

  # Geometry: explicit options first, then what the allocation says.
  if [[ -z $nodes ]]; then
    nodes=$(moe_slurm_int SLURM_JOB_NUM_NODES)
    [[ -n $nodes ]] || nodes=$(moe_slurm_int SLURM_NNODES)
    if [[ -z $nodes ]]; then
      ((dry_run)) || moe_die "--nodes: not given and SLURM_JOB_NUM_NODES is not set"
      nodes=2
    fi
  fi
  moe_check_int --nodes "$nodes" 1
  if [[ -z $tasks_per_node ]]; then
    # One rank per GPU: the GPUs of the node decide, unless this is a CPU-only run.
    ((cpu_only)) || tasks_per_node=$(moe_slurm_int SLURM_GPUS_ON_NODE)
    [[ -n $tasks_per_node && $tasks_per_node != 0 ]] || tasks_per_node=$(moe_slurm_int SLURM_NTASKS_PER_NODE)
    [[ -n $tasks_per_node ]] || tasks_per_node=8
  fi
  moe_check_int --tasks-per-node "$tasks_per_node" 1
  if [[ -z $cpus_per_task ]]; then
    local node_cpus
    node_cpus=$(moe_slurm_int SLURM_CPUS_ON_NODE)
    if [[ -n $node_cpus ]] && ((node_cpus / tasks_per_node >= 1)); then
      cpus_per_task=$((node_cpus / tasks_per_node))
    fi
  fi
  [[ -z $cpus_per_task ]] || moe_check_int --cpus-per-task "$cpus_per_task" 1

  # The tcp preset binds the loopback on one host, the default-route interface otherwise.
  moe_load_preset "$preset" "$((nodes == 1))"
  if [[ $PRESET_SCOPE == single-node ]] && ((nodes > 1)); then
    moe_die "--preset $preset: its provider only reaches ranks on one host, and this job has" \
      "$nodes nodes; use efa, cx7 or tcp, or --nodes 1"
  fi
  provider=${provider:-$PRESET_PROVIDER}
  moe_check_choice --provider "$provider" "${MOE_PROVIDERS[@]}"
  if [[ $provider == shm ]] && ((nodes > 1)); then
    moe_die "--provider shm: shared memory only reaches ranks on one host, and this job has $nodes nodes"
  fi
  moe_fabric_env "$provider"
  moe_resolve_cli "$dry_run"

  if [[ -z $trace ]]; then
    trace=${MOE_A2A_TRACE_DIR:-${SLURM_SUBMIT_DIR:-$PWD}/traces}/$mode-$model-$job_id.h5
  fi

  local -a srun=(
    srun
    # The ranks need the fabric settings; state it, whatever SLURM_EXPORT_ENV says.
    --export=ALL
    # A rank that dies must end the job, not leave its peers waiting for it.
    --kill-on-bad-exit=1
    --nodes="$nodes" --ntasks="$((nodes * tasks_per_node))" --ntasks-per-node="$tasks_per_node"
  )
  if [[ -n $cpus_per_task ]]; then
    # Each rank runs Python plus a transfer-engine thread: give it a block of cores.
    srun+=(--cpus-per-task="$cpus_per_task" --cpu-bind=cores)
  fi
  # Consecutive ranks on consecutive cores of one socket: local ranks 0-3 land on
  # the socket of GPUs 0-3 on two-socket 8-GPU nodes (p5en, DGX H100).
  srun+=(--distribution=block:block)
  local -a device=(--device cpu)
  if ((!cpu_only)); then
    # One GPU per rank, but no per-rank GPU isolation (--gpu-bind=none): ranks of a
    # node map each other's buffers with CUDA IPC, which needs every GPU visible.
    srun+=(--gpus-per-node="$tasks_per_node" --gpu-bind=none)
    device=(--device cuda)
  fi
  [[ -z $srun_mpi ]] || srun+=(--mpi="$srun_mpi")

  local -a run_args=(run --mode "$mode" --model "$model" --provider "$provider" "${device[@]}" --trace "$trace")
  [[ -z $iters ]] || run_args+=(--iters "$iters")
  [[ -z $warmup ]] || run_args+=(--warmup "$warmup")
  ((verify == 0)) || run_args+=(--verify)

  if ((!dry_run)); then
    mkdir -p -- "$(dirname -- "$trace")"
    printf '%s: job %s: %s x %s ranks, preset %s, provider %s, trace %s\n' \
      "$MOE_PROG" "$job_id" "$nodes" "$tasks_per_node" "$preset" "$provider" "$trace" >&2
  fi
  moe_launch "$dry_run" env "${MOE_ENV[@]}" "${srun[@]}" "${MOE_CLI[@]}" "${run_args[@]}" "${extra[@]}"
}
