# shellcheck shell=bash
# Fabric preset "shm": libfabric's shared-memory provider. Every rank on one host;
# the fastest way to exercise the fabric path of the protocol without a NIC.
# Sourced by jobs/lib.sh (moe_load_preset).

preset_describe "libfabric shm: shared memory, one host only"
preset_provider shm
# shm moves bytes between processes of one host: the Slurm scripts refuse it
# for jobs of more than one node.
preset_scope single-node

# Nothing else to set. If the ranks cannot read each other's memory with
# process_vm_readv (CMA; some containers forbid ptrace between processes), shm
# falls back to its own copies; set FI_SHM_DISABLE_CMA=1 to skip the attempt.
