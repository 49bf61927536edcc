"""HF <-> Megatron-Core parameter map for every supported family (dense, MoE, MLA).

Each Megatron parameter is described by a :class:`Rule`: which HF tensors it is made of, how to
merge them into the full (unsharded) Megatron tensor and split it back, and how tensor parallelism
cuts the full tensor. A routed expert's parameters are cut over the expert-tensor-parallel group
instead, and each expert-parallel rank holds its own experts (``expert_offset`` is the global
index of its first). The functions are pure: no I/O, no process groups.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from megatron_rlhf.errors import UserError
from megatron_rlhf.models.hf_config import ModelArch

# How TP cuts a full tensor: by rows, by columns, not at all, or per-half of a gated MLP's fc1.
ROWS, COLS, REPLICATED, GLU_ROWS = "rows", "cols", "replicated", "glu_rows"


@dataclass(frozen=True)
class Rule:
    """One Megatron parameter and the HF tensors it corresponds to."""

    hf_names: tuple[str, ...]
    merge: Callable[[list[torch.Tensor]], torch.Tensor]
    split: Callable[[torch.Tensor], list[torch.Tensor]]
    tp_cut: str
    expert: bool = False  # a routed expert's: cut over the expert-TP group, owned by one EP rank


def _same(tensors):
    return tensors[0]


def _one(tensor):
    return [tensor]


def tp_shard(full: torch.Tensor, cut: str, rank: int, size: int) -> torch.Tensor:
    """This TP rank's piece of ``full`` (contiguous, so it is safe to send over gloo)."""
    if cut == REPLICATED or size == 1:
        return full.contiguous()
    if cut == ROWS:
        return full.chunk(size, dim=0)[rank].contiguous()
    if cut == COLS:
        return full.chunk(size, dim=1)[rank].contiguous()
    if cut == GLU_ROWS:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]], dim=0).contiguous()
    raise ValueError(cut)


def tp_unshard(shards: list[torch.Tensor], cut: str) -> torch.Tensor:
    """Inverse of :func:`tp_shard` given every rank's piece in rank order."""
    if cut == REPLICATED or len(shards) == 1:
        return shards[0]
    if cut == ROWS:
        return torch.cat(shards, dim=0)
    if cut == COLS:
        return torch.cat(shards, dim=1)
    if cut == GLU_ROWS:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    raise ValueError(cut)


def _qkv_rules(arch: ModelArch, hf_layer: str, suffix: str) -> Rule:
    """Megatron stores q, k, v interleaved per query group: ``[ng, (q_per_group + 2) * d, ...]``."""
    groups, head_dim = arch.num_query_groups, arch.head_dim
    q_per_group = arch.num_attention_heads // groups

    def merge(tensors):
        q, k, v = tensors
        tail = q.shape[1:]
        q = q.reshape(groups, q_per_group * head_dim, *tail)
        k = k.reshape(groups, head_dim, *tail)
        v = v.reshape(groups, head_dim, *tail)
        return torch.cat([q, k, v], dim=1).reshape(-1, *tail)

    def split(full):
        tail = full.shape[1:]
        grouped = full.reshape(groups, (q_per_group + 2) * head_dim, *tail)
        q, k, v = grouped.split([q_per_group * head_dim, head_dim, head_dim], dim=1)
        return [t.reshape(-1, *tail).contiguous() for t in (q, k, v)]

    names = tuple(f"{hf_layer}.self_attn.{p}_proj.{suffix}" for p in "qkv")
    return Rule(names, merge, split, ROWS)


def _vocab_rule(hf_name: str, vocab: int, padded: int) -> Rule:
    def merge(tensors):
        table = tensors[0]
        if table.shape[0] != vocab:
            raise UserError(f"{hf_name} has {table.shape[0]} rows but the config says vocab_size="
                            f"{vocab}")
        pad = table.new_zeros(padded - vocab, *table.shape[1:])
        return torch.cat([table, pad], dim=0)

    return Rule((hf_name,), merge, lambda full: [full[:vocab].contiguous()], ROWS)


_LAYER_RULES = {
    # megatron suffix (local spec name | TE fused name) -> (HF suffix, TP cut)
    "input_layernorm.weight": ("input_layernorm.weight", REPLICATED),
    "self_attention.linear_qkv.layer_norm_weight": ("input_layernorm.weight", REPLICATED),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", COLS),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", REPLICATED),
    "mlp.linear_fc1.layer_norm_weight": ("post_attention_layernorm.weight", REPLICATED),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight", COLS),
    # Qwen3 QK norm (per head)
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight", REPLICATED),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight", REPLICATED),
    # MoE router and shared experts
    "mlp.router.weight": ("mlp.gate.weight", REPLICATED),
    "mlp.router.expert_bias": ("mlp.gate.e_score_correction_bias", REPLICATED),
    "mlp.shared_experts.gate_weight": ("mlp.shared_expert_gate.weight", REPLICATED),
}

# Multi-latent attention (DeepSeek-V3); the low-rank norms are fused into the up projections in
# Transformer Engine's spec. The down projections are column-parallel in megatron's local spec
# (gathered after the matmul) and replicated in TE's.
_MLA_RULES = {
    "self_attention.linear_q_proj.weight": ("self_attn.q_proj.weight", ROWS),
    "self_attention.linear_q_down_proj.weight": ("self_attn.q_a_proj.weight", None),
    "self_attention.q_layernorm.weight": ("self_attn.q_a_layernorm.weight", REPLICATED),
    "self_attention.linear_q_up_proj.layer_norm_weight": ("self_attn.q_a_layernorm.weight", REPLICATED),
    "self_attention.linear_q_up_proj.weight": ("self_attn.q_b_proj.weight", ROWS),
    "self_attention.linear_kv_down_proj.weight": ("self_attn.kv_a_proj_with_mqa.weight", None),
    "self_attention.kv_layernorm.weight": ("self_attn.kv_a_layernorm.weight", REPLICATED),
    "self_attention.linear_kv_up_proj.layer_norm_weight": ("self_attn.kv_a_layernorm.weight", REPLICATED),
    "self_attention.linear_kv_up_proj.weight": ("self_attn.kv_b_proj.weight", ROWS),
}

_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT_NAME = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight")


def _glu(hf_prefix: str, cut: str, expert: bool = False) -> Rule:
    names = (f"{hf_prefix}.gate_proj.weight", f"{hf_prefix}.up_proj.weight")
    return Rule(names, lambda ts: torch.cat(ts, dim=0), lambda full: list(full.chunk(2, 0)), cut,
                expert)


def _mlp_rule(arch: ModelArch, hf_layer: str, suffix: str, expert_offset: int) -> Rule | None:
    """Dense MLP, shared experts and routed experts (local expert j is global j + offset)."""
    if suffix == "mlp.linear_fc1.weight":
        return _glu(f"{hf_layer}.mlp", GLU_ROWS)
    shared = "shared_experts" if arch.family == "deepseek_v3" else "shared_expert"
    if suffix == "mlp.shared_experts.linear_fc1.weight":
        return _glu(f"{hf_layer}.mlp.{shared}", GLU_ROWS)
    if suffix == "mlp.shared_experts.linear_fc2.weight":
        return Rule((f"{hf_layer}.mlp.{shared}.down_proj.weight",), _same, _one, COLS)
    match = _EXPERT_NAME.fullmatch(suffix)
    if match is None:
        return None
    hf_expert = f"{hf_layer}.mlp.experts.{int(match.group(1)) + expert_offset}"
    if match.group(2) == "linear_fc1":
        return _glu(hf_expert, GLU_ROWS, expert=True)
    return Rule((f"{hf_expert}.down_proj.weight",), _same, _one, COLS, expert=True)


def rule_for(name: str, arch: ModelArch, padded_vocab: int, layer_offset: Callable[[int], int],
             hf_prefix: str = "model", expert_offset: int = 0, local_spec: bool = True) -> Rule:
    """The rule for Megatron parameter ``name`` (local name on this pipeline stage).

    ``layer_offset(j)`` maps a stage-local layer index to its global index; ``expert_offset`` is
    the global index of this expert-parallel rank's first expert; ``local_spec`` says whether
    the model is built from megatron's local layers (else Transformer Engine's).
    """
    if name == "embedding.word_embeddings.weight":
        return _vocab_rule(f"{hf_prefix}.embed_tokens.weight", arch.vocab_size, padded_vocab)
    if name == "decoder.final_layernorm.weight":
        return Rule((f"{hf_prefix}.norm.weight",), _same, _one, REPLICATED)
    if name == "output_layer.weight":
        if arch.kind == "value":
            return Rule(("score.weight",), _same, _one, REPLICATED)
        source = f"{hf_prefix}.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
        return _vocab_rule(source, arch.vocab_size, padded_vocab)
    match = _LAYER_NAME.fullmatch(name)
    if match is None:
        raise UserError(f"no HF mapping for Megatron parameter {name!r}")
    hf_layer = f"{hf_prefix}.layers.{layer_offset(int(match.group(1)))}"
    suffix = match.group(2)
    if arch.mla is not None and suffix in _MLA_RULES:
        hf_suffix, cut = _MLA_RULES[suffix]
        cut = cut or (ROWS if local_spec else REPLICATED)
        return Rule((f"{hf_layer}.{hf_suffix}",), _same, _one, cut)
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        return _qkv_rules(arch, hf_layer, suffix.rsplit(".", 1)[1])
    rule = _mlp_rule(arch, hf_layer, suffix, expert_offset)
    if rule is not None:
        return rule
    if suffix in _LAYER_RULES:
        hf_suffix, cut = _LAYER_RULES[suffix]
        return Rule((f"{hf_layer}.{hf_suffix}",), _same, _one, cut)
    raise UserError(f"no HF mapping for Megatron parameter {name!r}")


def layer_offsets(model) -> Callable[[int], int]:
    """Stage-local layer index -> global layer index, read from the built layers themselves."""
    numbers = [layer.layer_number - 1 for layer in model.decoder.layers]
    return lambda local: numbers[local]


# Run-time state megatron keeps in the state dict, not weights: routers' token counts.
_NOT_WEIGHTS = ("local_tokens_per_expert",)


def mapped_parameters(model):
    """(name, tensor) for every Megatron weight the map covers, in a stable order (LoRA adapters,
    ``*.adapter.lora_[ab]``, have no HF counterpart of their own: exports merge them)."""
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state") or not isinstance(tensor, torch.Tensor):
            continue
        if ".adapter.lora_" in name:
            continue
        if name.rsplit(".", 1)[-1] in _NOT_WEIGHTS:
            continue
        yield name, tensor
