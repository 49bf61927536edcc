"""HF <-> Megatron-Core parameter map for the dense Qwen2 and Llama families.

Each Megatron parameter is described by a :class:`Rule`: which HF tensors it is made of, how to
merge them into the full (unsharded) Megatron tensor and split it back, and how tensor parallelism
cuts the full tensor. The functions are pure: no I/O, no process groups.
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
}

_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def rule_for(name: str, arch: ModelArch, padded_vocab: int, layer_offset: Callable[[int], int],
             hf_prefix: str = "model") -> Rule:
    """The rule for Megatron parameter ``name`` (local name on this pipeline stage).

    ``layer_offset(j)`` maps a stage-local layer index to its global index.
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
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        return _qkv_rules(arch, hf_layer, suffix.rsplit(".", 1)[1])
    if suffix == "mlp.linear_fc1.weight":
        names = (f"{hf_layer}.mlp.gate_proj.weight", f"{hf_layer}.mlp.up_proj.weight")
        return Rule(names, lambda ts: torch.cat(ts, dim=0), lambda full: list(full.chunk(2, 0)),
                    GLU_ROWS)
    if suffix in _LAYER_RULES:
        hf_suffix, cut = _LAYER_RULES[suffix]
        return Rule((f"{hf_layer}.{hf_suffix}",), _same, _one, cut)
    raise UserError(f"no HF mapping for Megatron parameter {name!r}")


def layer_offsets(model) -> Callable[[int], int]:
    """Stage-local layer index -> global layer index, read from the built layers themselves."""
    numbers = [layer.layer_number - 1 for layer in model.decoder.layers]
    return lambda local: numbers[local]


def mapped_parameters(model):
    """(name, tensor) for every Megatron weight the map covers, in a stable order."""
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state") or not isinstance(tensor, torch.Tensor):
            continue
        yield name, tensor
