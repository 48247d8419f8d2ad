# shellcheck shell=bash
# Fabric preset "cx7": InfiniBand or RoCE on NVIDIA ConnectX-7 (400 Gb/s per GPU)
# through libfabric's verbs provider under ofi_rxm (the engine asks for
# "verbs;ofi_rxm"). The engine's direct libibverbs backend (RC queue pairs,
# docs/design.md section 3) is not built yet; until it is, ConnectX-7 goes through
# libfabric. Sourced by jobs/lib.sh (moe_load_preset).

preset_describe "InfiniBand/RoCE ConnectX-7 (libfabric verbs under ofi_rxm)"
preset_provider verbs
preset_scope multi-node

# FI_VERBS_DEVICE_NAME: a prefix or full name of the RDMA devices libfabric may
# use. ConnectX HCAs are mlx5_*; the prefix keeps libfabric off other RDMA
# devices on the node (a management NIC, an EFA). MOE_A2A_IB_DEVICE overrides.
preset_default FI_VERBS_DEVICE_NAME "${MOE_A2A_IB_DEVICE:-mlx5}"

# FI_VERBS_IFACE: the IP interface (prefix) tied to the RDMA devices, which
# librdmacm needs to resolve addresses (IPoIB on InfiniBand, the Ethernet port on
# RoCE). Only set when MOE_A2A_IB_IFACE is given: libfabric's own choice is
# right on most clusters.
preset_default FI_VERBS_IFACE "${MOE_A2A_IB_IFACE:-}"

# NCCL_IB_HCA: the same devices for NCCL, should torch.distributed run NCCL in the
# same job (a torch process group for bootstrap or a baseline all_to_all).
preset_default NCCL_IB_HCA "${MOE_A2A_IB_DEVICE:-mlx5}"

# MOE_A2A_NUM_NICS=1: one ConnectX-7 per GPU, the one on its PCIe switch
# (moe_a2a.nics); MOE_A2A_NICS names them instead ("mlx5_0;mlx5_1;...").
preset_default MOE_A2A_NUM_NICS 1
preset_default MOE_A2A_NICS ""
