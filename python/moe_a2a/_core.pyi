"""moe-a2a core: transfer engine and dispatch/combine"""

from collections.abc import Sequence
import enum
from typing import Final, overload


class FabricError(RuntimeError):
    pass

class FabricTimeoutError(FabricError):
    pass

def libfabric_providers() -> list[str]:
    """Provider names libfabric offers on this machine."""

def libfabric_domains(provider: str) -> list[str]:
    """
    Domain (device) names a provider offers for the engine's endpoints, in libfabric's order.
    """

def backend_names() -> list[str]:
    """Backends built into this module (open_backend's names)."""

def backend_capabilities(provider: str, domain: str = '', backend: str = 'libfabric', gpu_memory: bool = False) -> dict:
    """
    Opens one endpoint of `provider` (on `domain`, default the first) and returns what its backend reports (`gpu_memory`: as a CUDA rank opens it, asking for FI_HMEM).
    """

def make_imm(tag: int, peer: int) -> int: ...

IMM_PIECE_BIT: int = 32768

MAX_RANKS: int = 32768

class ImmCounters:
    def __init__(self, num_nics: int) -> None: ...

    def add(self, wire_imm: int) -> None:
        """Counts one arrival as it came off the wire."""

    def count(self, imm: int) -> int:
        """Whole writes of `imm` counted."""

    def wait(self, imm: int, count: int, timeout_s: float) -> bool:
        """Waits for and consumes `count` writes; False on timeout."""

class Region:
    """A memory region registered with this rank's engine."""

    def __init__(self, value: int) -> None: ...

    @property
    def value(self) -> int: ...

    def __eq__(self, arg: Region, /) -> bool: ...

    def __hash__(self) -> int: ...

    def __repr__(self) -> str: ...

class RemoteRegion:
    """A peer's region, as its descriptor told us."""

    def __init__(self, value: int) -> None: ...

    @property
    def value(self) -> int: ...

    def __eq__(self, arg: RemoteRegion, /) -> bool: ...

    def __hash__(self) -> int: ...

    def __repr__(self) -> str: ...

class Group:
    """Peers bound to their remote regions, with the requests built once."""

    def __init__(self, value: int) -> None: ...

    @property
    def value(self) -> int: ...

    def __eq__(self, arg: Group, /) -> bool: ...

    def __hash__(self) -> int: ...

    def __repr__(self) -> str: ...

def split_write(slot: int, length: int, num_nics: int, threshold: int) -> list[tuple[int, int, int]]:
    """Pieces (nic, offset, length) of one write."""

def nic_for_peer(slot: int, num_nics: int) -> int: ...

def peer_slot(rank: int, peer: int, world: int) -> int: ...

def rail_slot(rank: int, peer: int, world: int, per_node: int) -> int: ...

def encode_address(provider: str, nics: Sequence[bytes]) -> bytes: ...

def decode_address(blob: bytes) -> tuple[str, list[bytes]]: ...

class ScatterItem:
    @overload
    def __init__(self) -> None: ...

    @overload
    def __init__(self, peer: int, src_offset: int, length: int, dst_offset: int) -> None: ...

    @property
    def peer(self) -> int: ...

    @peer.setter
    def peer(self, arg: int, /) -> None: ...

    @property
    def src_offset(self) -> int: ...

    @src_offset.setter
    def src_offset(self, arg: int, /) -> None: ...

    @property
    def length(self) -> int: ...

    @length.setter
    def length(self, arg: int, /) -> None: ...

    @property
    def dst_offset(self) -> int: ...

    @dst_offset.setter
    def dst_offset(self, arg: int, /) -> None: ...

class ProxyEngine:
    @property
    def rank(self) -> int: ...

    @property
    def world(self) -> int: ...

    def write(self, region: Region, src_offset: int, length: int, remote: RemoteRegion, dst_offset: int, tag: int | None = None) -> None: ...

    def scatter(self, group: Group, region: Region, items: Sequence[ScatterItem], tag: int | None = None) -> None: ...

    def barrier(self, group: Group, tag: int, timeout_s: float) -> None: ...

    def wait_imm(self, tag: int, peer: int, count: int, timeout_s: float) -> None: ...

    def imm_count(self, tag: int, peer: int) -> int: ...

    def wait_tx(self, timeout_s: float) -> None: ...

    @property
    def tx_submitted(self) -> int: ...

    @property
    def tx_completed(self) -> int: ...

    @property
    def error(self) -> str: ...

class TransferEngine(ProxyEngine):
    def __init__(self, rank: int, world: int, provider: str = 'tcp', num_nics: int = 1, split_threshold: int = 1048576, domains: Sequence[str] = [], backend: str = 'libfabric', gpu_memory: bool = False) -> None: ...

    @property
    def num_nics(self) -> int: ...

    @property
    def provider(self) -> str: ...

    @property
    def backend(self) -> str: ...

    def capabilities(self, nic: int = 0) -> dict:
        """What NIC `nic`'s backend reports it can do."""

    def address(self) -> bytes: ...

    def connect(self, addresses: Sequence[bytes]) -> None: ...

    def watch_peers(self, fds: Sequence[int]) -> None:
        """
        Connected sockets, one per peer on another host (index = rank, -1 for none), whose EOF means the peer is gone; the engine owns and closes them.
        """

    def peer_gone(self, peer: int) -> bool:
        """Whether the peer's control connection (watch_peers) has closed."""

    def leave(self) -> None:
        """
        This process is ending after its writes were handed over (wait_tx first): tell the peers on other hosts, whose waits then let those writes land after its control connection closes.
        """

    def peer_left(self, peer: int) -> bool:
        """
        Whether the peer said goodbye (leave) on its control connection before it went.
        """

    def forgive_peer(self, peer: int) -> None:
        """
        The peer is gone and every survivor masked it: failures of writes to it, past and future, no longer fail the engine (every instance that shares it).
        """

    def reconnect_peer(self, peer: int, address: bytes) -> None:
        """
        Rank `peer` is a new process (moe_a2a.rejoin): writes go to its `address` and its failures count again; nothing where the address is unchanged.
        """

    def watch_peer(self, peer: int, fd: int) -> None:
        """
        A replaced peer's liveness connection (as watch_peers); the old one closes.
        """

    def forget_peer_imm(self, peer: int, tag: int, mask: int) -> None:
        """
        Drop the counted arrivals from `peer` whose tag & mask == tag (a replaced rank's old process's).
        """

    def register_region(self, ptr: int, length: int, kind: str = 'host', device: int = -1, name: str = 'region') -> Region: ...

    def region_descriptor(self, arg: Region, /) -> bytes: ...

    def add_remote_region(self, peer: int, descriptor: bytes) -> RemoteRegion: ...

    def create_group(self, peers: Sequence[int], remote_regions: Sequence[RemoteRegion], rails: int = 0) -> Group:
        """
        rails: ranks per node where the group's data goes only to the peers with our local index on other nodes (rows per node), whose NICs are then spread by node distance (0: by plain distance).
        """

    def release(self, region: Region, group: Group | None) -> None: ...

    def arrivals(self, nic: int) -> int:
        """Immediates that arrived on NIC `nic` (debug)."""

    @property
    def hot_path_allocations(self) -> int:
        """
        Times a queue of the write path grew (a heap allocation); 0 once the groups are registered.
        """

class MemoryEngine(ProxyEngine):
    def register_region(self, ptr: int, length: int) -> Region: ...

    def add_remote_region(self, peer: int, peer_region: Region) -> RemoteRegion:
        """Peer's region, by the Region its own engine returned."""

    def create_group(self, peers: Sequence[int], remote_regions: Sequence[RemoteRegion]) -> Group: ...

    def release(self, region: Region, group: Group | None) -> None: ...

class MemoryFabric:
    """Every rank of a world in this process; writes delivered in memory."""

    def __init__(self, world: int) -> None: ...

    @property
    def world(self) -> int: ...

    def engine(self, rank: int) -> MemoryEngine: ...

    def hold(self, src: int, dst: int = -1) -> None:
        """Writes from src (to dst; -1: anyone) are held from now on."""

    def release(self, src: int, dst: int = -1, order: str = 'posted', seed: int = 0) -> int:
        """
        Delivers the held writes from src (to dst) in order 'posted', 'reversed' or 'shuffled' (by seed) and stops holding them; returns how many.
        """

    def held(self, src: int = -1, dst: int = -1) -> int: ...

    def wait_held(self, src: int, dst: int, count: int, timeout_s: float = 30.0) -> bool:
        """True once count writes from src (to dst; -1: any) are held."""

    def fail_writes(self, src: int, dst: int, why: str) -> None:
        """
        Every later write from src to dst (-1: anyone) fails its sender's engine with `why`.
        """

    def kill(self, rank: int) -> None:
        """
        The rank is gone: its held writes are lost, its engine fails, writes to it fail.
        """

    def wait_blocked(self, rank: int, peer: int = -1, timeout_s: float = 30.0) -> bool:
        """
        True once rank waits for peer (-1: anyone) and found nothing; False after timeout_s.
        """

    def log(self) -> list[tuple[int, int, int, int]]:
        """Every write delivered so far, in order: (src, dst, tag or -1, length)."""

class CapacityError(RuntimeError):
    pass

class StaleGraphError(RuntimeError):
    pass

class PeerFailedError(RuntimeError):
    pass

FP8_BLOCK: int = 128

FP8_MAX: float = 448.0

MASKED_EXPERT: int = -2

def instance_tags(instance: int) -> tuple[int, int]:
    """
    (tag, mask) that every immediate tag of instance slot `instance` matches (signals.h).
    """

def fence_tag(instance: int) -> int:
    """
    The fence tag of instance slot `instance`: the survivors' zero-byte write after a loss (moe_a2a.masking).
    """

def f32_to_e4m3(f32: bytes) -> bytes:
    """
    fp32 values (bytes) to e4m3fn codes (bytes), as the CPU dispatch quantises.
    """

def quantize_fp8_rows(f32: bytes, hidden: int) -> tuple[bytes, bytes]:
    """
    fp32 rows (bytes) to (e4m3 codes, fp32 block scales), as dispatch packs them.
    """

def f32_to_bf16(f32: bytes) -> bytes: ...

class DType(enum.Enum):
    bf16 = 0

    fp32 = 1

    fp8 = 2

class FabricRows(enum.Enum):
    expert = 0

    rank = 1

    node = 2

class A2AConfig:
    def __init__(self) -> None: ...

    @property
    def rank(self) -> int: ...

    @rank.setter
    def rank(self, arg: int, /) -> None: ...

    @property
    def world(self) -> int: ...

    @world.setter
    def world(self, arg: int, /) -> None: ...

    @property
    def ranks_per_node(self) -> int: ...

    @ranks_per_node.setter
    def ranks_per_node(self, arg: int, /) -> None: ...

    @property
    def max_tokens(self) -> int: ...

    @max_tokens.setter
    def max_tokens(self, arg: int, /) -> None: ...

    @property
    def hidden(self) -> int: ...

    @hidden.setter
    def hidden(self, arg: int, /) -> None: ...

    @property
    def num_experts(self) -> int: ...

    @num_experts.setter
    def num_experts(self, arg: int, /) -> None: ...

    @property
    def topk(self) -> int: ...

    @topk.setter
    def topk(self, arg: int, /) -> None: ...

    @property
    def dispatch_dtype(self) -> DType: ...

    @dispatch_dtype.setter
    def dispatch_dtype(self, arg: DType, /) -> None: ...

    @property
    def combine_dtype(self) -> DType: ...

    @combine_dtype.setter
    def combine_dtype(self, arg: DType, /) -> None: ...

    @property
    def expert_padding(self) -> int: ...

    @expert_padding.setter
    def expert_padding(self, arg: int, /) -> None: ...

    @property
    def max_private_tokens(self) -> int: ...

    @max_private_tokens.setter
    def max_private_tokens(self, arg: int, /) -> None: ...

    @property
    def max_recv_tokens(self) -> int: ...

    @max_recv_tokens.setter
    def max_recv_tokens(self, arg: int, /) -> None: ...

    @property
    def timeout_s(self) -> float: ...

    @timeout_s.setter
    def timeout_s(self, arg: float, /) -> None: ...

    @property
    def instance(self) -> int: ...

    @instance.setter
    def instance(self, arg: int, /) -> None: ...

    @property
    def slice_bytes(self) -> int: ...

    @slice_bytes.setter
    def slice_bytes(self, arg: int, /) -> None: ...

    @property
    def fabric_rows(self) -> FabricRows: ...

    @fabric_rows.setter
    def fabric_rows(self, arg: FabricRows, /) -> None: ...

    @property
    def routing_width(self) -> int: ...

    @property
    def max_output_rows(self) -> int: ...

    max_instances: Final[int] = ...
    """(arg: object, /) -> int"""

    @property
    def dispatch_row_bytes(self) -> int: ...

    @property
    def combine_row_bytes(self) -> int: ...

    @property
    def workspace_bytes(self) -> int: ...

    @property
    def caller_timeout_s(self) -> float:
        """
        How long a rank waits for its proxy, and a closed instance's memory stays (the deadline rule).
        """

    def validate(self) -> None: ...

def plan_memory(config: A2AConfig, cuda: bool, share_rows: bool, has_remote: bool) -> dict[str, int]:
    """
    Bytes per rank by kind (memory_plan.h), for config as this rank would open it.
    """

class Workspace:
    def __init__(self, config: A2AConfig, name: str, share_rows: bool = True) -> None: ...

    @property
    def name(self) -> str: ...

    @property
    def ptr(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def routing_offset(self) -> int: ...

    def map_node(self, names: Sequence[str]) -> None: ...

    def unlink(self) -> None: ...

    def reopen_path(self) -> str: ...

    def remap_peer(self, rank: int, name: str) -> None:
        """
        Same-node `rank` was replaced (moe_a2a.rejoin): map `name` (its reopen_path) in its place.
        """

    def forget_sender(self, sender: int) -> None:
        """
        Drop the abort record a replaced rank's old process left in our workspace.
        """

class CpuAllToAll:
    def __init__(self, workspace: Workspace, engine: ProxyEngine | None, region: Region | None, group: Group | None, remote_peers: Sequence[int], pids: Sequence[int], masked: Sequence[int] = [], first_epoch: int = 0) -> None:
        """
        masked: per rank, 1 for a lost rank nobody waits for or sends to (empty: none); first_epoch: dispatches already started (the next call is epoch first_epoch + 1).
        """

    def announce_failure(self, text: str) -> None: ...

    def dispatch_send(self, x: int, x_dtype: DType, x_scale: int, topk_ids: int, num_tokens: int, routing: int = 0, weights: int = 0) -> None:
        """
        routing: a cached call's matrix (0: exchange the routing rows); weights: [T, topk] fp32, each copy's weight into its row's tail (0: zeros).
        """

    def dispatch_wait(self) -> int: ...

    def unpack_order(self) -> list[int]: ...

    def dispatch_unpack(self, out_x: int, out_scale: int, out_weight: int = 0, row_scale: int = 0, dot_y: int = 0, dot_y_dtype: DType = DType.bf16, dot_out: int = 0) -> None:
        """
        out_weight: [output rows] fp32, each row's weight from its tail (0: not wanted); row_scale ([rows] fp32): rows delivered times it; dot_y ([rows, hidden], dot_y_dtype): dot_out[r] = <row r as received, dot_y[r]>.
        """

    def combine_send(self, y: int, y_dtype: DType, row_values: int = 0, weighted: bool = True) -> None:
        """
        row_values: [output rows] fp32, one per row back in its tail (0: zeros); weighted: rows per rank are summed with the dispatch's weights (False: plainly), as the combine that follows.
        """

    def combine_recv(self, weights: int, out: int, values_out: int = 0) -> None:
        """
        values_out: [T, topk] fp32, each copy's returned value, unreduced (0: not wanted).
        """

    @property
    def tokens_per_expert(self) -> list[int]: ...

    def copy_routing(self, out: int) -> None:
        """
        The last dispatch's routing matrix [world][num_experts + world] (uint32) into out.
        """

    @property
    def routing_rows_sent(self) -> int: ...

    @property
    def routing_rows_received(self) -> int: ...

    def sent_counts(self) -> list[int]:
        """
        Wire rows sent to each rank in the last dispatch (copies, but rows per rank).
        """

    def received_counts(self) -> list[int]:
        """
        Wire rows received from each rank in the last dispatch (copies, but rows per rank).
        """

    def forwarded_traffic(self) -> tuple[list[int], list[int]]:
        """
        Rows per node in the last call, per node peer: the rows we forwarded that hold its entries (it read them from us), and the bytes of its outputs and row values our combine read.
        """

    @property
    def epoch(self) -> int: ...

def agree_on_live(workspace: Workspace, pids: Sequence[int], dead: Sequence[int], epoch: int, first_round: int, timeout_s: float) -> tuple[list[int], int, int]:
    """
    Rounds of proposals in each rank's own workspace until every survivor proposes the same dead ranks; returns (dead per rank, the most dispatches any survivor started, the deciding round).
    """

HAVE_CUDA: bool = True

def cuda_tuning() -> dict:
    """
    The launch tuning of this build's CUDA kernels, one dict per kernel family (src/a2a/cuda/tuning.h).
    """

def cuda_pooled_workspace_bytes() -> int:
    """
    Bytes of device workspaces kept for reuse: one registered for GPU-direct is never freed while the process lives (a peer's libfabric may still map it), and a later instance takes it back.
    """

class CudaAllToAll:
    @overload
    def __init__(self, workspace: Workspace, engine: ProxyEngine | None, region: Region | None, group: Group | None, remote_peers: Sequence[int], pids: Sequence[int] = []) -> None: ...

    @overload
    def __init__(self, config: A2AConfig) -> None:
        """
        A rank without fabric or proxy, for tests that run several ranks in one process.
        """

    def ipc_handle(self) -> bytes: ...

    def open_node(self, handles: Sequence[bytes]) -> None: ...

    def release_peer(self, rank: int) -> None:
        """
        A masked same-node rank is being replaced (moe_a2a.rejoin): let go of its old mappings, before the workspace remaps it.
        """

    def replace_peer(self, rank: int, handle: bytes, workspace: Workspace, pid: int) -> None:
        """
        A masked rank's replacement (proxy stopped): its IPC handle (same node; b'' elsewhere), the workspace's new mapping of it, its pid. The next mask() without it reaches it.
        """

    def connect_local(self, peer: CudaAllToAll) -> None: ...

    def rows_on_device(self, region: Region, group: Group, nic_writes: bool) -> None:
        """
        GPU-direct, before the first call: the proxy writes rows from and into the registered device workspace.
        """

    def kernel_waits(self) -> None:
        """
        Graph-safe instances, before the first call: every receive waits in kernels, and rows per node are forwarded in the stream.
        """

    def maskable(self) -> None:
        """
        Instances that may be masked (on_peer_loss='mask'), before the first call: every kernel checks that its graph was not captured before a mask.
        """

    def stop_proxy(self) -> None:
        """Stop the proxy thread (a retired close)."""

    def mask(self, masked: Sequence[int], first_epoch: int, group: Group | None, rows_group: Group | None, remote_peers: Sequence[int]) -> None:
        """
        Mask and continue, after a loss the survivors agreed on (device synchronised, proxy stopped): masked per rank (1: lost), the next call is epoch first_epoch + 1, the proxy serves the live remote_peers through group (rows_group: GPU-direct's). No collective.
        """

    @property
    def gpu_direct(self) -> bool: ...

    @property
    def device_epoch(self) -> int:
        """
        The device's epoch counter (a D2H copy): graph replays raise it, not the host's epoch.
        """

    def dispatch_send(self, x: int, x_dtype: DType, x_scale: int, topk_ids: int, ids_64bit: bool, num_tokens: int, num_tokens_device: int, stream: int, routing: int = 0, in_place: bool = False, weights: int = 0, dequant_recv: bool = False) -> None:
        """
        routing: a cached call's matrix in pinned host memory (0: exchange the routing rows). dequant_recv: the receive half dequantises fp8 rows (then in_place holds for a bf16/fp32 x too). in_place: x stays unchanged until the receive half, which reads this rank's own copies from it. weights: [T, topk] fp32, each copy's weight into its row's tail (0: zeros).
        """

    def dispatch_recv(self, out_x: int, out_scale: int, tokens_per_expert: int, host_wait: bool, stream: int, routing_out: int = 0, row_scale: int = 0, dot_y: int = 0, dot_y_dtype: DType = DType.bf16, dot_out: int = 0, out_weight: int = 0, dequant: bool = False, out_dtype: DType = DType.bf16) -> None:
        """
        row_scale (fp32, one per output row): rows delivered times it; dot_y ([rows, hidden], dot_y_dtype): dot_out[r] = <row r as received, dot_y[r]> in fp32; out_weight ([rows] fp32): each row's weight; dequant: fp8 rows delivered as out_dtype (bf16 or fp32) rows in out_x.
        """

    def combine_send(self, y: int, y_dtype: DType, y_rows: int, stream: int, in_place: bool = False, row_values: int = 0, weighted: bool = True) -> None:
        """
        in_place: y stays unchanged until the receive half, which reads this rank's own rows from it. row_values: [y_rows] fp32, one per row back in its tail (0: zeros). weighted: rows per rank or node are summed where the experts are times the dispatch's weights (false: plainly). With fabric_rows='node' it blocks until every same-node peer staged its outputs.
        """

    def combine_recv(self, weights: int, out: int, host_wait: bool, stream: int, values_out: int = 0) -> None:
        """
        values_out: [T, topk] fp32, each copy's returned value, unreduced (0: not wanted).
        """

    def check(self) -> None:
        """Raise the outcome of the last call (after synchronising its stream)."""

    def announce_failure(self, text: str) -> None:
        """Tell every peer that this rank failed, so their waits end at once."""

    def wait_planned(self) -> None:
        """
        Eager dispatch: wait until the plan of this call is final (no stream synchronisation), then check().
        """

    @property
    def status(self) -> int: ...

    @property
    def output_rows(self) -> int: ...

    @property
    def max_output_rows(self) -> int: ...

    def wire_received(self) -> list[int]:
        """
        Wire rows each sender sent us in the last planned dispatch (synchronises with the device).
        """

    def forwarded_traffic(self) -> tuple[list[int], list[int]]:
        """
        Rows per node, the last planned dispatch, per node peer: the rows we forwarded that it read entries from, and the bytes of its outputs and row values our combine read (synchronises with the device).
        """

    @property
    def fused_recv(self) -> bool:
        """
        Eager dispatch_recv plans and copies in one launch (no other rank of the node on our GPU).
        """

    @property
    def epoch(self) -> int: ...

    @property
    def routing_rows_sent(self) -> int: ...

    @property
    def routing_rows_received(self) -> int: ...

    @property
    def layout(self) -> dict[str, int]: ...

    @property
    def device_workspace(self) -> int: ...

    @property
    def host_workspace(self) -> int: ...

    @property
    def signals(self) -> dict[str, int]: ...
