# shellcheck shell=bash
# Fabric preset "efa": AWS Elastic Fabric Adapter through libfabric's efa provider
# (SRD: reliable, unordered). Production target: p5en (8 x H200, 16 x 200 Gb/s EFA
# per node). Sourced by jobs/lib.sh (moe_load_preset).

preset_describe "AWS EFA (libfabric efa, SRD), e.g. p5en; production"
preset_provider efa
preset_scope multi-node

# FI_EFA_USE_DEVICE_RDMA=1: require the NIC's RDMA read/write. p5en's EFA has it;
# without it libfabric would emulate every one-sided write with send/receive
# messages, several times slower. With 1, a node whose EFA cannot do RDMA stops
# at start-up with a message instead of running slowly.
preset_default FI_EFA_USE_DEVICE_RDMA 1

# FI_EFA_FORK_SAFE=1 (libfabric) and RDMAV_FORK_SAFE=1 (rdma-core, for any other
# verbs user in the process): the ranks are Python processes that may fork
# (subprocess, torch compile workers) after buffers are registered; on kernels
# without copy-on-fork for pinned pages (before 5.13) a child could otherwise
# corrupt registered memory. On newer kernels libfabric sees that the kernel
# handles it and this costs nothing. It also turns off libfabric's huge-page
# bounce buffers (FI_EFA_USE_HUGE_PAGE), which this engine does not rely on.
preset_default FI_EFA_FORK_SAFE 1
preset_default RDMAV_FORK_SAFE 1

# FI_EFA_ENABLE_SHM_TRANSFER=0: efa would open a shm endpoint for peers on its
# host; moe-a2a never sends to them through the engine (same-node ranks share
# memory directly, CUDA IPC on the GPU), so it would cost memory and a
# /dev/shm file per rank, and shm's own CUDA IPC handling with GPU-direct.
preset_default FI_EFA_ENABLE_SHM_TRANSFER 0

# MOE_A2A_NUM_NICS=2: p5en has two EFA per GPU; each rank opens the two on its
# GPU's PCIe switch (moe_a2a.nics). MOE_A2A_NICS names them instead, e.g.
# "rdmap79s0-rdm,rdmap80s0-rdm;..." (one group per local rank).
preset_default MOE_A2A_NUM_NICS 2
preset_default MOE_A2A_NICS ""
