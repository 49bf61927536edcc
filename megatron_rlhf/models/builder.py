"""Megatron-Core model builders: a policy (LM head) and a value/reward model (scalar head).

One value module serves both the PPO critic and the Bradley-Terry reward model: a ``GPTModel``
whose output layer is a ``[hidden] -> 1`` projection of the final-normed hidden state. Dense,
MoE and MLA families all build here: Transformer Engine layer specs when TE imports (GPU),
megatron-core's local specs otherwise.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from megatron_rlhf.distributed.layout import ParallelGroups
from megatron_rlhf.distributed.platform import device, has_transformer_engine, platform_is_cpu
from megatron_rlhf.errors import UserError
from megatron_rlhf.models.hf_config import ModelArch, RopeScaling, padded_vocab_size
from megatron_rlhf.models.megatron_config import ModelOptions, transformer_config

_META = torch.device("meta")


def uses_transformer_engine() -> bool:
    """Whether models are built from Transformer Engine layers (GPU with TE installed)."""
    return has_transformer_engine()


@functools.cache
def sdpa_core_attention():
    """megatron-core's local core attention with ``torch.nn.functional.scaled_dot_product_attention``
    as its kernel: the local one materialises the ``[b, heads, s, s]`` scores (and their softmax
    and its gradient) and copies K/V once per query head for GQA; SDPA's fused CPU and GPU
    kernels do neither. Megatron's own path still runs where SDPA cannot reproduce it (attention
    dropout while training, a learnable softmax offset, query-key layer scaling)."""
    import torch.nn.functional as F
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class SDPADotProductAttention(DotProductAttention):
        def _megatron_only(self) -> bool:
            dropout = self.training and self.attention_dropout.p > 0
            return (dropout or self.softmax_offset is not None
                    or self.config.apply_query_key_layer_scaling)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):
            if self._megatron_only() or attention_bias is not None or packed_seq_params is not None:
                return super().forward(query, key, value, attention_mask, attn_mask_type,
                                       attention_bias, packed_seq_params)
            causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
            # [s, b, heads, d] -> [b, heads, s, d]; a given mask (True = may not attend, causal
            # already folded in) wins over the causal type, as in megatron's softmax.
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            allowed = None if attention_mask is None else ~attention_mask
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, is_causal=causal and allowed is None and q.shape[2] > 1,
                scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
            context = context.permute(2, 0, 1, 3).contiguous()
            return context.view(*context.shape[:2], self.hidden_size_per_partition)

    return SDPADotProductAttention


def _mla_core_attention():
    """megatron-core 0.16.1's MLA passes ``k_channels``/``v_channels`` to its core attention, which
    only TE's accepts (``TypeError`` with the local one); MLA's value heads are ``v_head_dim``
    wide, not ``kv_channels``, so the local attention's output is sized by them."""
    from megatron.core.utils import divide

    class MLADotProductAttention(sdpa_core_attention()):
        def __init__(self, config, layer_number, attn_mask_type, attention_type,
                     attention_dropout=None, softmax_scale=None, k_channels=None,
                     v_channels=None, cp_comm_type=None, pg_collection=None):
            super().__init__(config, layer_number, attn_mask_type, attention_type,
                             attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                             cp_comm_type=cp_comm_type, pg_collection=pg_collection)
            if v_channels is not None:
                tp = self.pg_collection.tp.size()
                self.hidden_size_per_partition = divide(v_channels * config.num_attention_heads, tp)
                self.hidden_size_per_attention_head = v_channels

    return MLADotProductAttention


def _layer_spec(arch: ModelArch, moe_layer: bool):
    from megatron.core.models.gpt import gpt_layer_specs

    experts = arch.moe.num_experts if moe_layer else None
    mla = arch.mla is not None
    if uses_transformer_engine():
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=False, qk_layernorm=arch.qk_norm,
            multi_latent_attention=mla)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=experts, moe_grouped_gemm=False, qk_layernorm=arch.qk_norm,
        multi_latent_attention=mla, normalization="RMSNorm")
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = _mla_core_attention() if mla else sdpa_core_attention()
    return spec


def layer_specs(arch: ModelArch, groups: ParallelGroups):
    """One layer spec for a uniform dense model; else the block spec of this pipeline stage's
    layers (dense and MoE layers mixed as ``arch.moe.layer_pattern`` says)."""
    if arch.moe is None and arch.mla is None:
        return _layer_spec(arch, moe_layer=False)
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    pattern = arch.moe.layer_pattern if arch.moe else (0,) * arch.num_layers
    first, count = groups.layout.stage_of(arch.num_layers, groups.pp_rank)
    specs = {flag: _layer_spec(arch, bool(flag)) for flag in set(pattern)}
    local = [specs[flag] for flag in pattern[first:first + count]]
    if uses_transformer_engine():
        from megatron.core.extensions.transformer_engine import TENorm as norm
    else:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm as norm
    return TransformerBlockSubmodules(layer_specs=local, layer_norm=norm)


class ValueHead(nn.Module):
    """``[s, b, h] -> [s, b, 1]``, replicated on every TP rank; drop-in for GPTModel.output_layer."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, sequence_parallel: bool, tp_group):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device()))
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        del weight, runtime_gather_output  # part of the output-layer interface; unused here
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, group=self.tp_group)
        return torch.matmul(hidden_states, self.weight.t()), None


def _llama3_frequencies(model, scaling: RopeScaling) -> None:
    """Llama 3.x RoPE scaling with the checkpoint's own factors (megatron's GPTModel option fixes
    low/high frequency factors and the original context at Llama 3.1's values)."""
    rotary = model.rotary_pos_emb
    rotary.inv_freq = rotary._apply_scaling(
        rotary.inv_freq, factor=scaling.factor, low_freq_factor=scaling.low_freq_factor,
        high_freq_factor=scaling.high_freq_factor,
        original_max_position_embeddings=scaling.original_max_position_embeddings)


_ANNOUNCED: set = set()


def _announce_split(layout, num_layers: int) -> None:
    """The one line saying how uneven pipeline stages were split (rank 0, once per split)."""
    import torch.distributed as dist

    line = layout.describe_stages(num_layers)
    if line and line not in _ANNOUNCED and (not dist.is_initialized() or dist.get_rank() == 0):
        _ANNOUNCED.add(line)
        print(f"[model] {line}", flush=True)


def build_model(arch: ModelArch, groups: ParallelGroups, dtype: torch.dtype = torch.float32,
                padded_vocab: int | None = None, options: ModelOptions | None = None):
    """Build this rank's stage of ``arch`` under ``groups``' layout.

    ``padded_vocab`` fixes the embedding rows (a checkpoint's value); by default the vocab is
    padded for the layout's TP size. Returns a ``GPTModel`` on this process's device.
    """
    from dataclasses import replace

    from megatron.core.models.gpt import GPTModel

    layout = groups.layout
    vocab = padded_vocab or padded_vocab_size(arch.vocab_size, layout.tp)
    if vocab % layout.tp:
        raise UserError(f"padded vocab {vocab} is not divisible by tp={layout.tp}")
    options = replace(options or ModelOptions(), expert_tensor_parallel_size=layout.etp)
    config = transformer_config(arch, layout.tp, layout.pp, dtype,
                                use_cpu_initialization=platform_is_cpu(), ep=layout.ep,
                                options=options,
                                stage_ends=layout.stage_ends(arch.num_layers))
    _announce_split(layout, arch.num_layers)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_specs(arch, groups),
        vocab_size=vocab,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=groups.is_first_stage,
        post_process=groups.is_last_stage,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        # MLA applies its own (yarn or plain) rotary embedding inside attention.
        position_embedding_type="none" if arch.mla else "rope",
        rotary_base=arch.rope_theta,
        pg_collection=groups.collection,
    )
    if arch.rope_scaling is not None and arch.rope_scaling.kind == "llama3":
        _llama3_frequencies(model, arch.rope_scaling)
    _sum_replicated_expert_grads(model, layout)
    if arch.kind == "value" and groups.is_last_stage:
        model.output_layer = ValueHead(arch.hidden_size, dtype, config.sequence_parallel, groups.tp)
    # Without Transformer Engine or apex, megatron's norms are torch's and ignore params_dtype:
    # a bf16 model kept fp32 norm weights, which megatron's mixed-precision optimizer then
    # misnumbered when saving its state (as Float16Module would, every parameter gets the dtype).
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    return model.to(device())


def _sum_replicated_expert_grads(model, layout) -> None:
    """At TP > 1 with EP = 1 and expert TP 1, every TP rank holds all experts whole and routes
    its own sequence shard through them, yet megatron-core 0.16.1 treats experts at EP = 1 as
    dense weights (``allreduce=True``: reduced over DP only), so each rank kept its own tokens'
    share of their gradients (measured: off by their own size on tiny Qwen3-MoE; megatron-LM
    avoids the layout by defaulting expert TP to TP). Tagged as sequence-parallel, their
    gradients are summed over TP by ``finalize_model_grads``, as norm weights' are, and (whole on
    every TP rank) counted once in the gradient norm, not once per TP rank."""
    if layout.tp == 1 or layout.ep > 1 or layout.etp > 1:
        return
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.sequence_parallel = True
            param.tensor_model_parallel = False


class _OnMeta(TorchFunctionMode):
    """Sends the explicit device requests of a model build to the meta device too.

    ``torch.device("meta")`` only sets the default: megatron's GPU path asks for
    ``device=torch.cuda.current_device()`` and ``build_model`` ends with ``.to(device())``, which
    would allocate (or refuse to copy out of meta). Dtype casts still apply.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _META
        if func in (torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.to) and args[0].is_meta:
            dtype = kwargs.get("dtype")
            dtype = dtype or next((a for a in args[1:] if isinstance(a, torch.dtype)), None)
            return args[0] if dtype is None else func(args[0], dtype=dtype)
        return func(*args, **kwargs)


def build_meta_model(arch: ModelArch, groups: ParallelGroups, dtype: torch.dtype,
                     padded_vocab: int):
    """:func:`build_model` with every parameter and buffer on the meta device: the names, shapes
    and sharded keys of this rank's stage without its bytes (what streaming conversions plan
    from)."""
    with torch.device(_META), _OnMeta():
        return build_model(arch, groups, dtype, padded_vocab)
