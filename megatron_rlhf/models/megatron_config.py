"""``ModelArch`` + layout + training options -> megatron-core's ``TransformerConfig``.

Fusions are off so CPU and GPU compute the same thing; the options that change memory or
communication, not the model (sequence parallelism, activation recompute, the MoE token
dispatcher and its auxiliary losses), come from the trainer's config as :class:`ModelOptions`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_rlhf.models.hf_config import ModelArch


@dataclass(frozen=True)
class ModelOptions:
    """How a model runs under training; none of these change what it computes."""

    sequence_parallel: bool = False
    recompute_granularity: Optional[str] = None  # "full" | "selective"
    recompute_method: Optional[str] = None  # "uniform" | "block" (full only)
    recompute_num_layers: Optional[int] = None
    recompute_modules: Optional[tuple[str, ...]] = None  # selective: core_attn, mlp, moe, ...
    moe_aux_loss_coef: float = 0.0
    moe_z_loss_coef: float = 0.0
    moe_load_balancing: str = "aux_loss"  # aux_loss | seq_aux_loss | none
    moe_expert_bias_update_rate: float = 1e-3
    moe_token_dispatcher: str = "alltoall"  # alltoall | allgather
    expert_tensor_parallel_size: int = 1
    moe_routing_replay: bool = False
    """Give each router megatron's ``RouterReplay`` (routing is unchanged until it is driven)."""


def _moe_kwargs(arch: ModelArch, options: ModelOptions) -> dict:
    moe = arch.moe
    if moe is None:
        return {}
    balancing = options.moe_load_balancing if options.moe_aux_loss_coef > 0 else "none"
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.topk,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_layer_freq=list(moe.layer_pattern),
        moe_shared_expert_intermediate_size=moe.shared_ffn_hidden_size or None,
        moe_shared_expert_gate=moe.shared_expert_gate,
        moe_router_score_function=moe.score_function,
        moe_router_pre_softmax=moe.pre_softmax,
        moe_router_enable_expert_bias=moe.expert_bias,
        moe_router_bias_update_rate=options.moe_expert_bias_update_rate,
        moe_router_num_groups=moe.num_groups,
        moe_router_group_topk=moe.group_topk,
        moe_router_topk_scaling_factor=moe.scaling_factor,
        # fp32 routing on every device: top-k choices must not flip between TP/EP layouts.
        moe_router_dtype="fp32",
        moe_grouped_gemm=False,
        moe_token_dispatcher_type=options.moe_token_dispatcher,
        moe_router_load_balancing_type=balancing,
        moe_aux_loss_coeff=options.moe_aux_loss_coef,
        moe_z_loss_coeff=options.moe_z_loss_coef or None,
        expert_tensor_parallel_size=options.expert_tensor_parallel_size,
        moe_enable_routing_replay=options.moe_routing_replay,
    )


def _mla_kwargs(arch: ModelArch) -> dict:
    mla, scaling = arch.mla, arch.rope_scaling
    kwargs = dict(multi_latent_attention=True, q_lora_rank=mla.q_lora_rank,
                  kv_lora_rank=mla.kv_lora_rank, qk_head_dim=mla.qk_nope_head_dim,
                  qk_pos_emb_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim,
                  rotary_base=arch.rope_theta, rope_type="rope")
    if scaling is not None:  # yarn (the reader allows nothing else for MLA)
        kwargs.update(rope_type="yarn", rotary_scaling_factor=scaling.factor,
                      original_max_position_embeddings=scaling.original_max_position_embeddings,
                      beta_fast=scaling.beta_fast, beta_slow=scaling.beta_slow,
                      mscale=scaling.mscale, mscale_all_dim=scaling.mscale_all_dim)
    return kwargs


def transformer_config(arch: ModelArch, tp: int, pp: int, dtype: torch.dtype,
                       use_cpu_initialization: bool, ep: int = 1,
                       options: ModelOptions | None = None,
                       stage_ends: tuple[int | None, int | None] = (None, None)):
    """The ``TransformerConfig`` (``MLATransformerConfig`` for MLA) for ``arch`` under a layout;
    ``stage_ends``: layers of the first and last pipeline stage when they differ."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    options = options or ModelOptions()
    kwargs = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=None if arch.mla else arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        qk_layernorm=arch.qk_norm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=arch.initializer_range,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        num_layers_in_first_pipeline_stage=stage_ends[0],
        num_layers_in_last_pipeline_stage=stage_ends[1],
        expert_model_parallel_size=ep,
        sequence_parallel=options.sequence_parallel,
        recompute_granularity=options.recompute_granularity,
        recompute_method=options.recompute_method,
        recompute_num_layers=options.recompute_num_layers,
        recompute_modules=list(options.recompute_modules) if options.recompute_modules else None,
        use_cpu_initialization=use_cpu_initialization,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        **_moe_kwargs(arch, options),
    )
    if arch.mla:
        return MLATransformerConfig(**kwargs, **_mla_kwargs(arch))
    return TransformerConfig(**kwargs)
