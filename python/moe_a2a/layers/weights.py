"""Weights of one MoE layer in TorchTitan's layout: random, loaded, sharded by rank.

State-dict keys (this library's own names; TorchTitan 0.3.0's in brackets, same layouts):
  router.gate.weight          [E, D]
  experts.w1, experts.w3      [E, F, D] (routed_experts.inner_experts.w1_EFD, w3_EFD)
  experts.w2                  [E, D, F] (routed_experts.inner_experts.w2_EDF)
  shared_experts.w1.weight    [Fs, D]   (linear weights; absent without a shared expert)
  shared_experts.w3.weight    [Fs, D]
  shared_experts.w2.weight    [D, Fs]
  expert_bias                 [E]       (expert_bias_E; optional: load-balancing bias of the router)
Rank r keeps experts [r * E/N, (r+1) * E/N), the block that the all-to-all sends it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch

from moe_a2a.layers.presets import MoEShape

GATE = "router.gate.weight"
EXPERT_KEYS = ("experts.w1", "experts.w2", "experts.w3")
SHARED_KEYS = ("shared_experts.w1.weight", "shared_experts.w2.weight", "shared_experts.w3.weight")
BIAS = "expert_bias"
# Buffers TorchTitan keeps in the same module that the forward pass does not need.
IGNORED_KEYS = ("tokens_per_expert", "tokens_per_expert_E")
# TorchTitan 0.3.0's names (torchtitan.models.common.moe.MoE) for the same tensors, same layouts.
TORCHTITAN_KEYS = {
    "routed_experts.inner_experts.w1_EFD": EXPERT_KEYS[0],
    "routed_experts.inner_experts.w2_EDF": EXPERT_KEYS[1],
    "routed_experts.inner_experts.w3_EFD": EXPERT_KEYS[2],
    "expert_bias_E": BIAS,
}


@dataclass
class MoEWeights:
    """Router, this rank's routed experts (global ids from `expert_offset`), shared expert."""

    gate: torch.Tensor  # [E, D], every expert: each rank routes its own tokens
    w1: torch.Tensor  # [E_local, F, D]
    w2: torch.Tensor  # [E_local, D, F]
    w3: torch.Tensor  # [E_local, F, D]
    expert_offset: int = 0
    shared_w1: torch.Tensor | None = None  # [Fs, D]
    shared_w2: torch.Tensor | None = None  # [D, Fs]
    shared_w3: torch.Tensor | None = None  # [Fs, D]
    expert_bias: torch.Tensor | None = None  # [E]

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]

    @property
    def num_local_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def hidden(self) -> int:
        return self.gate.shape[1]

    @property
    def expert_hidden(self) -> int:
        return self.w1.shape[1]

    @property
    def has_shared(self) -> bool:
        return self.shared_w1 is not None

    @property
    def shared(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(shared_w1, shared_w2, shared_w3), or None without a shared expert (all or none are set)."""
        if self.shared_w1 is None or self.shared_w2 is None or self.shared_w3 is None:
            return None
        return self.shared_w1, self.shared_w2, self.shared_w3

    def nbytes(self) -> int:
        """Bytes held by all tensors."""
        return sum(t.numel() * t.element_size() for t in self._tensors().values())

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> MoEWeights:
        """A copy on `device`; `dtype` applies to expert weights only (router stays as is)."""

        def move(t: torch.Tensor, cast: bool) -> torch.Tensor:
            return t.to(device=device, dtype=dtype if cast else None)

        def move_if(t: torch.Tensor | None, cast: bool) -> torch.Tensor | None:
            return None if t is None else move(t, cast)

        return replace(
            self,
            gate=move(self.gate, False),
            w1=move(self.w1, True),
            w2=move(self.w2, True),
            w3=move(self.w3, True),
            shared_w1=move_if(self.shared_w1, True),
            shared_w2=move_if(self.shared_w2, True),
            shared_w3=move_if(self.shared_w3, True),
            expert_bias=move_if(self.expert_bias, False),
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """TorchTitan-style state dict; only for weights that hold every expert."""
        if self.num_local_experts != self.num_experts:
            raise ValueError(
                f"state_dict: these weights hold {self.num_local_experts} of {self.num_experts} experts; "
                "a layer's state dict needs all of them"
            )
        return {k: v for k, v in self._tensors().items()}

    def _tensors(self) -> dict[str, torch.Tensor]:
        out = {GATE: self.gate, EXPERT_KEYS[0]: self.w1, EXPERT_KEYS[1]: self.w2, EXPERT_KEYS[2]: self.w3}
        shared = (self.shared_w1, self.shared_w2, self.shared_w3)
        out.update({k: t for k, t in zip(SHARED_KEYS, shared, strict=True) if t is not None})
        if self.expert_bias is not None:
            out[BIAS] = self.expert_bias
        return out


def local_experts(num_experts: int, rank: int, world_size: int) -> range:
    """Global ids of the experts that `rank` hosts (a contiguous block)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank: got {rank} of world size {world_size}; expected 0 <= rank < world size")
    if num_experts % world_size != 0:
        raise ValueError(
            f"num_experts: got {num_experts}, not divisible by the world size {world_size}; "
            "every rank must host the same number of experts"
        )
    per_rank = num_experts // world_size
    return range(rank * per_rank, (rank + 1) * per_rank)


def _generator(seed: int, tag: str, index: int = 0) -> torch.Generator:
    # One stream per (seed, tensor, expert), so any rank can make any expert alone and
    # every rank gets the same values for it.
    digest = hashlib.blake2b(f"{seed}/{tag}/{index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def _randn(shape: tuple[int, ...], std: float, seed: int, tag: str, index: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=_generator(seed, tag, index)) * std


def random_weights(
    shape: MoEShape,
    seed: int,
    experts: range | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    expert_bias: bool = False,
) -> MoEWeights:
    """Random weights for the experts in `experts` (default: all), made one expert at a time.

    Any process with the same `seed` gets the same values for an expert, so ranks
    can each make their own block and a single process can make the whole layer to
    check against, without anyone holding more than it keeps. Standard deviations are
    1/sqrt(fan-in), which keeps activations of order one. The router gate (and bias)
    stay fp32; the FFN weights are cast to `dtype`.
    """
    experts = range(shape.num_experts) if experts is None else experts
    if experts.step != 1 or experts.start < 0 or experts.stop > shape.num_experts:
        raise ValueError(f"experts: got {experts}; expected a contiguous range within 0..{shape.num_experts}")
    D, F = shape.hidden, shape.expert_hidden

    def ffn(tag: str, index: int, rows: int, cols: int) -> torch.Tensor:
        return _randn((rows, cols), cols**-0.5, seed, tag, index).to(dtype=dtype, device=device)

    def stack(tag: str, rows: int, cols: int) -> torch.Tensor:
        out = torch.empty((len(experts), rows, cols), dtype=dtype, device=device)
        for i, e in enumerate(experts):
            out[i] = ffn(tag, e, rows, cols)
        return out

    weights = MoEWeights(
        gate=_randn((shape.num_experts, D), D**-0.5, seed, "gate").to(device),
        w1=stack("w1", F, D),
        w2=stack("w2", D, F),
        w3=stack("w3", F, D),
        expert_offset=experts.start,
    )
    if shape.num_shared_experts:
        Fs = shape.shared_hidden
        weights.shared_w1 = ffn("shared_w1", 0, Fs, D)
        weights.shared_w2 = ffn("shared_w2", 0, D, Fs)
        weights.shared_w3 = ffn("shared_w3", 0, Fs, D)
    if expert_bias:
        # Small next to sigmoid scores, so it nudges the choice like a trained bias does.
        weights.expert_bias = _randn((shape.num_experts,), 0.02, seed, "expert_bias").to(device)
    return weights


def shard_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    rank: int = 0,
    world_size: int = 1,
    *,
    prefix: str = "",
    shape: MoEShape | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> MoEWeights:
    """This rank's part of a full (unsharded) TorchTitan MoE layer state dict.

    Keys are read under `prefix` (e.g. "layers.3.moe."); the router and shared expert
    are kept whole, routed experts only for this rank's block, copied so the full
    tensors can be freed. Shapes are checked against each other and, if given,
    against `shape`. `dtype` casts the expert weights.
    """
    layer, name = _layer_entries(state_dict, prefix)
    num_experts = _check_shapes(layer, prefix, name, shape)
    return _copy_block(layer, local_experts(num_experts, rank, world_size), dtype, device)


def _layer_entries(
    state_dict: Mapping[str, torch.Tensor], prefix: str
) -> tuple[dict[str, torch.Tensor], Callable[[str], str]]:
    """The layer's tensors under `prefix` by this library's names, and how the caller spelled each key."""
    layer = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    known = {GATE, *EXPERT_KEYS, *SHARED_KEYS, BIAS, *IGNORED_KEYS}
    unknown = sorted(set(layer) - known - set(TORCHTITAN_KEYS))
    if unknown:
        raise ValueError(
            f"state_dict: unexpected keys {[prefix + k for k in unknown]} under prefix {prefix!r}; "
            f"expected {sorted(known)} or TorchTitan's {sorted(TORCHTITAN_KEYS)}"
        )
    layer, given = _own_names(layer, prefix)

    def name(key: str) -> str:  # a key as the caller spelled it, for messages
        return prefix + given.get(key, key)

    missing = [k for k in (GATE, *EXPERT_KEYS) if k not in layer]
    if missing:
        raise ValueError(
            f"state_dict: missing {[prefix + k for k in missing]}; found {sorted(name(k) for k in layer)}"
        )
    return layer, name


def _check_shapes(
    layer: dict[str, torch.Tensor], prefix: str, name: Callable[[str], str], shape: MoEShape | None
) -> int:
    """Checks the tensors' shapes against each other and `shape`; returns the number of experts."""
    gate = layer[GATE]
    if gate.dim() != 2:
        raise ValueError(f"state_dict[{prefix + GATE!r}]: got shape {tuple(gate.shape)}; expected [E, D]")
    E, D = gate.shape
    w1 = layer[EXPERT_KEYS[0]]
    F = w1.shape[1] if w1.dim() == 3 else -1
    expected: dict[str, tuple[int, ...]] = {
        EXPERT_KEYS[0]: (E, F, D),
        EXPERT_KEYS[1]: (E, D, F),
        EXPERT_KEYS[2]: (E, F, D),
    }
    shared_present = [k for k in SHARED_KEYS if k in layer]
    if shared_present and len(shared_present) != len(SHARED_KEYS):
        raise ValueError(
            f"state_dict: got shared-expert keys {[prefix + k for k in shared_present]}; "
            f"expected all of {[prefix + k for k in SHARED_KEYS]} or none"
        )
    if shared_present:
        Fs = layer[SHARED_KEYS[0]].shape[0]
        expected.update({SHARED_KEYS[0]: (Fs, D), SHARED_KEYS[1]: (D, Fs), SHARED_KEYS[2]: (Fs, D)})
    if BIAS in layer:
        expected[BIAS] = (E,)
    for key, want in expected.items():
        got = tuple(layer[key].shape)
        if got != want:
            raise ValueError(
                f"state_dict[{name(key)!r}]: got shape {got}; expected {list(want)} "
                f"(E={E}, D={D} from {prefix + GATE!r}, F={F} from {name(EXPERT_KEYS[0])!r})"
            )
    if shape is not None:
        found = {
            "num_experts": E,
            "hidden": D,
            "expert_hidden": F,
            "shared_hidden": layer[SHARED_KEYS[0]].shape[0] if shared_present else 0,
        }
        for field_name, value in found.items():
            if getattr(shape, field_name) != value:
                raise ValueError(
                    f"state_dict: {field_name} is {value}; the model shape expects "
                    f"{getattr(shape, field_name)}"
                )
    return E


def _copy_block(
    layer: dict[str, torch.Tensor],
    block: range,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
) -> MoEWeights:
    """Copies of the router, the shared expert and the routed experts of `block`."""

    def keep(t: torch.Tensor, cast: bool = True, rows: range | None = None) -> torch.Tensor:
        if rows is not None:
            t = t[rows.start : rows.stop]
        # clone: a slice would keep the whole unsharded storage alive.
        return t.detach().to(device=device, dtype=dtype if cast else None).clone()

    def keep_if(t: torch.Tensor | None, cast: bool = True) -> torch.Tensor | None:
        return None if t is None else keep(t, cast)

    return MoEWeights(
        gate=keep(layer[GATE], cast=False),
        w1=keep(layer[EXPERT_KEYS[0]], rows=block),
        w2=keep(layer[EXPERT_KEYS[1]], rows=block),
        w3=keep(layer[EXPERT_KEYS[2]], rows=block),
        expert_offset=block.start,
        shared_w1=keep_if(layer.get(SHARED_KEYS[0])),
        shared_w2=keep_if(layer.get(SHARED_KEYS[1])),
        shared_w3=keep_if(layer.get(SHARED_KEYS[2])),
        expert_bias=keep_if(layer.get(BIAS), cast=False),
    )


def _own_names(layer: dict[str, torch.Tensor], prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """TorchTitan's names mapped to this library's (and own name -> name given); both at once is refused."""
    out = {k: v for k, v in layer.items() if k not in TORCHTITAN_KEYS}
    given: dict[str, str] = {}
    for titan, own in TORCHTITAN_KEYS.items():
        if titan not in layer:
            continue
        if own in layer:
            raise ValueError(
                f"state_dict: got both {prefix + titan!r} and {prefix + own!r}; expected one name per tensor"
            )
        out[own] = layer[titan]
        given[own] = titan
    return out, given


def full_layer_nbytes(shape: MoEShape, dtype: torch.dtype) -> int:
    """Bytes of the whole unsharded layer with expert weights in `dtype` (router in fp32)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    router = shape.num_experts * shape.hidden * 4
    return router + (shape.weight_elements() - shape.num_experts * shape.hidden) * itemsize
