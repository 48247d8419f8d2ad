# shellcheck shell=bash
# Shared code of the moe-a2a job scripts (jobs/run-local.sh, jobs/slurm/*.sbatch):
# argument checks, fabric presets, finding the moe-a2a command, and printing or
# running the final command line. Sourced, never executed.
#
# The caller sets, before sourcing:
#   MOE_PROG        name used in messages (e.g. "run-local.sh")
#   MOE_A2A_HOME    the repository root (the directory that holds jobs/)
#
# Every script builds its command as one bash array that starts with
# `env NAME=VALUE ...` for the fabric settings. A dry run prints exactly that
# array; a real run executes exactly that array. So the dry run is the command,
# not a description of it.
#
# The variables this file sets (MOE_ENV, MOE_CLI, PRESET_*, the MOE_* lists) are
# read by the scripts that source it, which shellcheck cannot see from here.
# shellcheck disable=SC2034

MOE_MODES=(decode prefill train)
MOE_MODELS=(deepseek-v3 kimi-k2 tiny)
MOE_PROVIDERS=(tcp shm efa verbs)
MOE_DEVICES=(cpu cuda)

# ------------------------------------------------------------------ messages

moe_die() {
  printf '%s: error: %s\n' "$MOE_PROG" "$*" >&2
  exit 2
}

moe_warn() {
  printf '%s: warning: %s\n' "$MOE_PROG" "$*" >&2
}

# ------------------------------------------------------------------ argument checks

# moe_need_value OPTION ARGC: OPTION takes a value, so at least two words must be left.
moe_need_value() {
  (($2 >= 2)) || moe_die "$1: missing value (see --help)"
}

# moe_check_int OPTION VALUE MINIMUM: a decimal integer >= MINIMUM.
moe_check_int() {
  local option=$1 value=$2 minimum=$3
  if [[ ! $value =~ ^[0-9]+$ ]] || ((10#$value < minimum)); then
    moe_die "$option: got '$value'; expected an integer >= $minimum"
  fi
}

# moe_check_choice OPTION VALUE CHOICE...: VALUE is one of the choices.
moe_check_choice() {
  local option=$1 value=$2 choice
  shift 2
  for choice in "$@"; do
    [[ $value == "$choice" ]] && return 0
  done
  moe_die "$option: got '$value'; expected one of: $*"
}

# ------------------------------------------------------------------ fabric presets
#
# A preset is jobs/presets/NAME.sh. It is sourced by moe_load_preset and calls only
# the preset_* functions below, so a preset is a flat list of settings that can be
# read at a glance and checked by shellcheck.

# preset_describe TEXT: one line for --help.
preset_describe() { PRESET_DESCRIPTION=$1; }

# preset_provider NAME: the libfabric provider this preset is for (tcp, shm, efa, verbs).
# The launcher exports it as FI_PROVIDER and MOE_A2A_PROVIDER and passes --provider.
preset_provider() { PRESET_PROVIDER=$1; }

# preset_scope single-node|multi-node: whether the provider reaches other hosts.
preset_scope() { PRESET_SCOPE=$1; }

# preset_default NAME VALUE: set NAME=VALUE for the ranks, unless NAME is already set
# in the caller's environment: then the caller's value is kept (and shown in the dry
# run). An empty VALUE means "leave NAME unset".
preset_default() {
  local name=$1 value=$2
  if [[ -n ${!name+set} ]]; then
    value=${!name}
  fi
  [[ -n $value ]] && PRESET_ENV+=("$name=$value")
  return 0
}

# moe_preset_names: the presets that exist, one per line, sorted.
moe_preset_names() {
  local file
  for file in "$MOE_A2A_HOME"/jobs/presets/*.sh; do
    [[ -e $file ]] || continue
    file=${file##*/}
    printf '%s\n' "${file%.sh}"
  done | sort
}

# moe_load_preset NAME SINGLE_HOST: source jobs/presets/NAME.sh. SINGLE_HOST (1 or 0)
# tells presets whose defaults differ between one host and a cluster (tcp) which one
# applies. Sets PRESET_PROVIDER, PRESET_SCOPE, PRESET_DESCRIPTION and PRESET_ENV.
moe_load_preset() {
  local name=$1 names
  mapfile -t names < <(moe_preset_names)
  moe_check_choice --preset "$name" "${names[@]}"
  PRESET_SINGLE_HOST=$2
  PRESET_PROVIDER=""
  PRESET_SCOPE=""
  PRESET_DESCRIPTION=""
  PRESET_ENV=()
  # The path is built at run time from the preset's name.
  # shellcheck disable=SC1090
  source "$MOE_A2A_HOME/jobs/presets/$name.sh"
  [[ -n $PRESET_PROVIDER ]] || moe_die "jobs/presets/$name.sh: the preset names no provider (preset_provider)"
  moe_check_choice "jobs/presets/$name.sh: preset_scope" "$PRESET_SCOPE" single-node multi-node
}

# moe_preset_help INDENT: "INDENT NAME  description" for every preset, for --help.
moe_preset_help() {
  local indent=$1 name names
  # Locals shadow the globals for the sourced presets (bash scoping is dynamic),
  # so describing the presets changes nothing in the caller.
  local PRESET_DESCRIPTION PRESET_PROVIDER PRESET_SCOPE PRESET_SINGLE_HOST=1
  local -a PRESET_ENV
  mapfile -t names < <(moe_preset_names)
  for name in "${names[@]}"; do
    PRESET_DESCRIPTION="(no description)"
    PRESET_ENV=()
    # shellcheck disable=SC1090
    source "$MOE_A2A_HOME/jobs/presets/$name.sh"
    printf '%s%-5s %s\n' "$indent" "$name" "$PRESET_DESCRIPTION"
  done
}

# moe_fabric_env PROVIDER: MOE_ENV=(FI_PROVIDER=... MOE_A2A_PROVIDER=... <preset settings>).
# FI_PROVIDER and MOE_A2A_PROVIDER always follow the chosen provider: a stale value in
# the caller's environment would otherwise hide the provider libfabric is asked for.
moe_fabric_env() {
  local provider=$1
  if [[ $provider != "$PRESET_PROVIDER" ]]; then
    moe_warn "--provider $provider with a preset made for '$PRESET_PROVIDER': the preset's other settings may not apply"
  fi
  MOE_ENV=("FI_PROVIDER=$provider" "MOE_A2A_PROVIDER=$provider" "${PRESET_ENV[@]}")
}

# moe_default_route_iface: the network interface of the default route on this host
# (from /proc/net/route, so no extra tools are needed), else eth0.
moe_default_route_iface() {
  local iface destination _rest
  if [[ -r /proc/net/route ]]; then
    while read -r iface destination _rest; do
      if [[ $destination == 00000000 ]]; then
        printf '%s\n' "$iface"
        return 0
      fi
    done </proc/net/route
  fi
  printf 'eth0\n'
}

# ------------------------------------------------------------------ the moe-a2a command

# moe_resolve_cli DRY_RUN: sets MOE_CLI to the command that runs the moe-a2a CLI.
# One rule, first match wins (docs/running.md):
#   1. $MOE_A2A_PYTHON -m moe_a2a.cli        (an explicit interpreter)
#   2. $MOE_A2A_HOME/.venv/bin/python -m moe_a2a.cli   (this checkout's virtualenv)
#   3. moe-a2a from PATH                     (a Spack view, a pip install)
# With DRY_RUN=1 a missing command is a warning, so the command line can still be shown.
moe_resolve_cli() {
  local dry_run=$1 exe
  if [[ -n ${MOE_A2A_PYTHON:-} ]]; then
    if ! exe=$(command -v -- "$MOE_A2A_PYTHON"); then
      moe_die "MOE_A2A_PYTHON: got '$MOE_A2A_PYTHON'; expected a Python interpreter that can import moe_a2a"
    fi
    MOE_CLI=("$exe" -m moe_a2a.cli)
  elif [[ -x $MOE_A2A_HOME/.venv/bin/python ]]; then
    MOE_CLI=("$MOE_A2A_HOME/.venv/bin/python" -m moe_a2a.cli)
  elif exe=$(command -v moe-a2a); then
    MOE_CLI=("$exe")
  elif ((dry_run)); then
    moe_warn "no moe-a2a command found (MOE_A2A_PYTHON, $MOE_A2A_HOME/.venv, PATH); showing 'moe-a2a'"
    MOE_CLI=(moe-a2a)
  else
    moe_die "no moe-a2a command found: set MOE_A2A_PYTHON to a Python that has moe_a2a installed," \
      "run tools/quickstart.sh setup to create $MOE_A2A_HOME/.venv, or put moe-a2a on PATH"
  fi
}

# ------------------------------------------------------------------ print or run

# moe_print_command WORD...: one line, each word quoted for the shell (bash printf %q),
# so the printed line can be pasted back into a shell and does the same thing.
moe_print_command() {
  local line
  printf -v line '%q ' "$@"
  printf '%s\n' "${line% }"
}

# moe_launch DRY_RUN WORD...: print the command (dry run) or show it on stderr and exec it.
moe_launch() {
  local dry_run=$1
  shift
  if ((dry_run)); then
    moe_print_command "$@"
    exit 0
  fi
  printf '%s: running: %s\n' "$MOE_PROG" "$(moe_print_command "$@")" >&2
  exec "$@"
}
