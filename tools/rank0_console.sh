#!/usr/bin/env bash
# Runs one MPI rank's command: rank 0 on the console, every other rank into
# $MOE_A2A_RANK_LOGS/rankN.log. A --junitxml argument is kept for rank 0 only.
# Open MPI's --output-filename sends every rank to files, or every rank to files
# and the console; neither keeps rank 0 alone live on the console (docs/running.md).
rank=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-${SLURM_PROCID:-0}}}
if [[ $rank == 0 ]]; then
  exec "$@"
fi
args=()
for a in "$@"; do
  [[ $a == --junitxml=* ]] || args+=("$a")
done
exec "${args[@]}" >"${MOE_A2A_RANK_LOGS:-.}/rank$rank.log" 2>&1
