"""Dispatch/combine the way a user of a collective library writes it: the benchmarks' baseline.

Quantise (fp8), sort the (token, k) copies by expert, exchange the counts, then
one all-to-all of token rows (each row carries its expert id), group the
received rows by local expert; combine sends the expert outputs back the same
way and takes the weighted sum with `index_add_`. The exchange is either
mpi4py's `Alltoall`/`Alltoallv` on host buffers or torch.distributed's
`all_to_all_single` (NCCL on GPUs, gloo on CPUs), counts first, as a user would.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import numpy as np
import torch

ID_BYTES = 4  # int32 expert id appended to each dispatched row


class MpiExchange:
    """mpi4py on host memory."""

    name = "MPI"

    def __init__(self, comm: Any) -> None:
        self.comm = comm

    def counts(self, send: torch.Tensor) -> torch.Tensor:
        recv = np.empty(send.numel(), dtype=np.int64)
        self.comm.Alltoall(send.cpu().numpy().astype(np.int64), recv)
        return torch.from_numpy(recv)

    def rows(self, send: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        width = send.shape[1]
        recv = np.empty((int(recv_counts.sum()), width), dtype=np.uint8)
        self.comm.Alltoallv(
            [send.cpu().numpy(), send_counts.numpy() * width], [recv, recv_counts.numpy() * width]
        )
        return torch.from_numpy(recv).to(send.device)


class TorchExchange:
    """torch.distributed `all_to_all_single` (NCCL on GPUs, gloo on CPUs)."""

    def __init__(self, comm: Any, device: torch.device) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.device = device
        backend = "nccl" if device.type == "cuda" else "gloo"
        self.name = backend.upper()
        if not dist.is_initialized():
            init_process_group(comm, backend)

    def counts(self, send: torch.Tensor) -> torch.Tensor:
        send = send.to(self.device)
        recv = torch.empty_like(send)
        self.dist.all_to_all_single(recv, send)
        return recv.cpu()  # the split sizes are host lists: a synchronisation, as for any user

    def rows(self, send: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        recv = torch.empty(int(recv_counts.sum()), send.shape[1], dtype=send.dtype, device=self.device)
        self.dist.all_to_all_single(
            recv,
            send.contiguous(),
            output_split_sizes=recv_counts.tolist(),
            input_split_sizes=send_counts.tolist(),
        )
        return recv

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


def init_process_group(comm: Any, backend: str) -> None:
    """torch.distributed's default group over the MPI ranks (gloo or nccl).

    Rendezvous at rank 0 on a port it picked, told to all through MPI: at
    127.0.0.1 when every rank is on rank 0's host, else at its host name.
    """
    import torch.distributed as dist

    hosts = comm.allgather(socket.gethostname())
    host = "127.0.0.1" if len(set(hosts)) == 1 else hosts[0]
    port = comm.bcast(_free_port() if comm.Get_rank() == 0 else None)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast
    dist.init_process_group(
        backend, init_method=f"tcp://{host}:{port}", rank=comm.Get_rank(), world_size=comm.Get_size()
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class Baseline:
    """Dispatch and combine over one exchange; the same contract as AllToAll for the benchmark."""

    def __init__(self, exchange: Any, world: int, num_experts: int, dispatch_dtype: str) -> None:
        self.exchange = exchange
        self.world = world
        self.local = num_experts // world
        self.fp8 = dispatch_dtype == "fp8"

    def dispatch(self, x: torch.Tensor, ids: torch.Tensor) -> dict[str, Any]:
        from moe_a2a.reference import quantize_fp8

        tokens, topk = ids.shape
        if self.fp8:
            q, scale = quantize_fp8(x)
            payload = torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=1)
        else:
            payload = x.contiguous().view(torch.uint8)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert, hence by rank
        token_of = order // topk
        experts = flat[order].to(torch.int32).unsqueeze(1).view(torch.uint8)
        send_rows = torch.cat([payload[token_of], experts], dim=1)
        send_counts = torch.bincount(flat // self.local, minlength=self.world).cpu()
        recv_counts = self.exchange.counts(send_counts)
        recv_rows = self.exchange.rows(send_rows, send_counts, recv_counts)
        recv_experts = recv_rows[:, -ID_BYTES:].contiguous().view(torch.int32).squeeze(1)
        group = torch.argsort(recv_experts, stable=True)
        return dict(
            expert_rows=recv_rows[group, :-ID_BYTES],
            group=group,
            order=order,
            token_of=token_of,
            send_counts=send_counts,
            recv_counts=recv_counts,
            tokens=tokens,
        )

    def expert_input(self, state: dict[str, Any], hidden: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The received rows as (payload, fp8 scales or None), like AllToAll's expert_x."""
        rows = state["expert_rows"]
        if not self.fp8:
            return rows.contiguous().view(torch.bfloat16), None
        return rows[:, :hidden].contiguous().view(torch.float8_e4m3fn), rows[:, hidden:].contiguous().view(
            torch.float32
        )

    def combine(self, y: torch.Tensor, state: dict[str, Any], weights: torch.Tensor) -> torch.Tensor:
        back = torch.empty_like(y)
        back[state["group"]] = y  # arrival order again
        rows = self.exchange.rows(back.view(torch.uint8), state["recv_counts"], state["send_counts"])
        hidden = y.shape[1]
        w = weights.reshape(-1)[state["order"]].unsqueeze(1)
        out = torch.zeros(state["tokens"], hidden, dtype=torch.float32, device=y.device)
        out.index_add_(0, state["token_of"], rows.view(y.dtype).float() * w)
        return out.to(torch.bfloat16)
