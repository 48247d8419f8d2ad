# shellcheck shell=bash
# Fabric preset "tcp": libfabric's tcp provider under ofi_rxm (the engine asks for
# "tcp;ofi_rxm"). Any IP network: CI, laptops, CPU-only clusters, and a fallback
# that works on every cluster. Sourced by jobs/lib.sh (moe_load_preset).

preset_describe "libfabric tcp (under ofi_rxm): any IP network; CI, CPU-only clusters"
preset_provider tcp
preset_scope multi-node

# FI_TCP_IFACE: the interface the tcp provider binds. Without it, tcp takes the
# first interface it finds, which may not route to the other ranks (or, on one
# host, to ourselves). One host: the loopback. A cluster: MOE_A2A_TCP_IFACE, else
# the interface of this host's default route (interface names are usually the
# same on every node of a cluster).
if ((PRESET_SINGLE_HOST)); then
  preset_default FI_TCP_IFACE "${MOE_A2A_TCP_IFACE:-lo}"
else
  preset_default FI_TCP_IFACE "${MOE_A2A_TCP_IFACE:-$(moe_default_route_iface)}"
fi
