"""TorchTitan trainer configs with moe-a2a's dispatcher: a config registry for `--module`.

TorchTitan's `--module` takes a module path and `--config` one of its functions, so

    torchrun ... -m moe_a2a.integrations.torchtitan_train \
        --module moe_a2a.integrations.torchtitan_configs --config deepseek_v3_debugmodel

trains TorchTitan's DeepSeek-V3 debug model with `MoeA2ATokenDispatcher` in every MoE
layer. `use_moe_a2a` does the same to any `Trainer.Config` (your own config function
can call it); `on_gloo` and `on_cpu` make a config train over gloo and on the CPU;
`write_tiny_assets` writes a tokenizer and a text dataset for the debug configs (see
docs/training.md).
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.fsdp import FSDPModule
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel as titan_debugmodel
from torchtitan.trainer import Trainer

from moe_a2a.integrations.torchtitan import MoeA2ATokenDispatcher


def use_moe_a2a(config: Trainer.Config, **dispatcher: Any) -> Trainer.Config:
    """Put `MoeA2ATokenDispatcher.Config(**dispatcher)` in every MoE layer of `config` (in place).

    `num_experts`, `top_k` and `hidden_dim` come from the model; `num_max_tokens_per_rank`,
    unless given, from the first batch.
    """
    for name in ("num_experts", "top_k", "hidden_dim"):
        if name in dispatcher:
            raise ValueError(f"use_moe_a2a: got {name}={dispatcher[name]!r}; it is taken from the model")
    model = config.model_spec.model if config.model_spec is not None else None
    moes = [layer.moe for layer in getattr(model, "layers", []) if getattr(layer, "moe", None) is not None]
    if model is None or not moes:
        raise ValueError("use_moe_a2a: config.model_spec has no MoE layer (layers[i].moe)")
    for moe in moes:
        moe.routed_experts.token_dispatcher = MoeA2ATokenDispatcher.Config(
            num_experts=moe.num_experts, top_k=moe.router.top_k, hidden_dim=model.dim, **dispatcher
        )
    if config.model_spec is not None:
        config.model_spec.parallelize_fn = _sized_for_compile(config.model_spec.parallelize_fn)
    # TorchTitan refuses CUDA graphs with any EP dispatcher that syncs with the host, as
    # moe-a2a's (and its own AllToAllTokenDispatcher) does: the counts come back to the host.
    config.training.disable_cuda_graphs = True
    return config


def _sized_for_compile(parallelize: Callable[..., Any]) -> Callable[..., Any]:
    """`parallelize`, with compile on: dispatchers without num_max_tokens_per_rank take
    local_batch_size * seq_len, so they open when TorchTitan wires their meshes (a compiled
    block cannot size them from its first batch: that is a collective outside the graph)."""

    @functools.wraps(parallelize)
    def parallelize_sized(model: Any, **kwargs: Any) -> Any:
        compile_config, training = kwargs.get("compile_config"), kwargs.get("training")
        if compile_config is not None and compile_config.enable and training is not None:
            if kwargs.get("ac_config") is not None:
                # torch 2.13 cannot recompute an ordered-effect op (moe-a2a's exchanges) in a
                # compiled backward: it fails inside AOTAutograd. Say so first, plainly.
                raise ValueError(
                    "--compile.enable with MoeA2ATokenDispatcher: got activation checkpointing on; "
                    "expected activation-checkpoint:none (recomputing the exchanges in a compiled "
                    "backward is not supported yet, see docs/training.md)"
                )
            tokens = training.local_batch_size * training.seq_len
            for module in model.modules():
                m = getattr(module, "token_dispatcher", None)  # not itself a module
                if isinstance(m, MoeA2ATokenDispatcher) and m.config.num_max_tokens_per_rank is None:
                    m.config.num_max_tokens_per_rank = tokens
        return parallelize(model, **kwargs)

    return parallelize_sized


def _sum_reductions(parallelize: Callable[..., Any]) -> Callable[..., Any]:
    """`parallelize` followed by FSDP reductions that are plain sums (gloo has no AVG or PREMUL_SUM)."""

    @functools.wraps(parallelize)
    def parallelize_for_gloo(model: Any, **kwargs: Any) -> Any:
        model = parallelize(model, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return model

    return parallelize_for_gloo


def on_gloo(config: Trainer.Config) -> Trainer.Config:
    """Make `config` train over a gloo process group (in place): the CPU, or ranks sharing a GPU.

    - FSDP reduces with plain sums: TorchTitan asks for a divide factor of 1, which
      FSDP turns into PREMUL_SUM, which gloo refuses.
    - SPMD backend "partial_dtensor": with TorchTitan 0.3.0's default ("spmd_types")
      `fully_shard` refuses the parameters on torch 2.13 ("all parameters must be
      DTensors on the full SPMD mesh"), and its AllToAllTokenDispatcher exchanges
      uneven splits through `all_to_all` on tensor lists there, which gloo refuses.
    """
    if config.model_spec is None:
        raise ValueError("on_gloo: config.model_spec is not set")
    config.model_spec.parallelize_fn = _sum_reductions(config.model_spec.parallelize_fn)
    config.parallelism.spmd_backend = "partial_dtensor"
    return config


def on_cpu(config: Trainer.Config) -> Trainer.Config:
    """`on_gloo`, and attention that trains on the CPU (in place); run it under torchtitan_train.

    Attention becomes SDPA, causal over the whole sequence: FlexAttention, TorchTitan's
    default, has no backward on the CPU. So SDPA does not mask document boundaries.
    """
    on_gloo(config)
    for layer in config.model_spec.model.layers:
        if getattr(layer, "attention", None) is not None:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def deepseek_v3_debugmodel() -> Trainer.Config:
    """TorchTitan's DeepSeek-V3 debug model (6 layers, 8 experts, top-3) with moe-a2a's dispatcher."""
    return use_moe_a2a(titan_debugmodel())


def deepseek_v3_debugmodel_gloo() -> Trainer.Config:
    """The same over gloo: several ranks on one GPU (with MOE_A2A_TORCHTITAN_BACKEND=gloo)."""
    return on_gloo(deepseek_v3_debugmodel())


def deepseek_v3_debugmodel_cpu() -> Trainer.Config:
    """The same, on the CPU."""
    return on_cpu(deepseek_v3_debugmodel())


def deepseek_v3_debugmodel_cpu_titan() -> Trainer.Config:
    """The reference: the debug model on the CPU with TorchTitan's own dispatcher (all-to-all at EP > 1)."""
    config = on_cpu(titan_debugmodel())
    config.training.disable_cuda_graphs = True  # as in use_moe_a2a: the same run, only the dispatcher differs
    return config


def write_tiny_assets(root: str | Path, documents: int = 300, seed: int = 0) -> tuple[Path, Path]:
    """A BPE tokenizer and a JSON-lines text dataset under `root`, for the debug configs.

    TorchTitan's debug configs name test assets its wheel lacks; pass the two
    directories returned as `--hf-assets-path` and `--dataloader.dataset-path`.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    words = ["the", "router", "sends", "each", "token", "to", "experts", "it", "picks", "and", "every"]
    words += ["expert", "reads", "its", "tokens", "a", "layer", "of", "mixture", "gate", "weight"]
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 120))) for _ in range(documents)]
    tokenizer_dir, data_dir = Path(root) / "tokenizer", Path(root) / "data"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<unk>", "<s>", "</s>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=256, special_tokens=specials))
    tok.save(str(tokenizer_dir / "tokenizer.json"))
    # TorchTitan's HuggingFaceTokenizer reads the BOS and EOS tokens from here.
    specials_config = {"bos_token": "<s>", "eos_token": "</s>"}
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(specials_config))
    return tokenizer_dir, data_dir
