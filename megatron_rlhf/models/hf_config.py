"""Hugging Face config -> Megatron-Core ``TransformerConfig`` adapter for dense decoder families.

Supported: Qwen2 / Qwen2.5 (``model_type="qwen2"``, QKV bias) and Llama (``model_type="llama"``),
as ``*ForCausalLM`` (policy) or ``*ForSequenceClassification`` with one label (value/reward model).
Anything else is refused up front with a one-line reason, never half-converted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_rlhf.distributed.layout import ModelShape
from megatron_rlhf.errors import UserError

SUPPORTED_FAMILIES = ("qwen2", "llama")
VOCAB_PAD_MULTIPLE = 128


@dataclass(frozen=True)
class ModelArch:
    """What a Megatron model needs from an HF config, checked once."""

    family: str  # "qwen2" | "llama"
    kind: str  # "policy" (LM head) | "value" (scalar head)
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    tie_word_embeddings: bool
    initializer_range: float

    @property
    def shape(self) -> ModelShape:
        return ModelShape(self.num_layers, self.num_attention_heads, self.num_query_groups,
                          self.vocab_size)


def padded_vocab_size(vocab_size: int, tp: int = 1) -> int:
    """Round the vocab up so every TP size dividing 128 (and ``tp``) splits it evenly.

    The padded size is fixed once per checkpoint, so one checkpoint loads under any such TP.
    """
    multiple = VOCAB_PAD_MULTIPLE * tp // math.gcd(VOCAB_PAD_MULTIPLE, tp)
    return -(-vocab_size // multiple) * multiple


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
        raise UserError(f"unsupported RoPE scaling {rope_type!r} in the Hugging Face config "
                        "(only plain RoPE is supported)")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise UserError("the Hugging Face config has no rope_theta")
    return float(theta)


def _model_kind(config) -> str:
    arch = (getattr(config, "architectures", None) or ["?"])[0]
    if arch.endswith("ForCausalLM"):
        return "policy"
    if arch.endswith("ForSequenceClassification"):
        if getattr(config, "num_labels", 1) != 1:
            raise UserError(f"{arch} with num_labels={config.num_labels}: a reward model needs "
                            "num_labels=1")
        return "value"
    raise UserError(f"unsupported architecture {arch!r}: expected *ForCausalLM or "
                    "*ForSequenceClassification")


def arch_from_hf_config(config) -> ModelArch:
    """Read and check an HF ``PretrainedConfig``; raises :class:`UserError` if unsupported."""
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise UserError(f"unsupported model_type {family!r}: supported are "
                        f"{', '.join(SUPPORTED_FAMILIES)}")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UserError(f"unsupported hidden_act {config.hidden_act!r} (expected silu)")
    if getattr(config, "mlp_bias", False):
        raise UserError("unsupported: mlp_bias=True")
    if family == "llama" and getattr(config, "attention_bias", False):
        raise UserError("unsupported: Llama attention_bias=True (output projection bias)")
    if getattr(config, "use_sliding_window", False):
        raise UserError("unsupported: use_sliding_window=True")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kind = _model_kind(config)
    return ModelArch(
        family=family,
        kind=kind,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=_rope_theta(config),
        qkv_bias=family == "qwen2" or bool(getattr(config, "attention_bias", False)),
        # A reward model's scalar head is never tied to the embedding.
        tie_word_embeddings=kind == "policy" and bool(getattr(config, "tie_word_embeddings", False)),
        initializer_range=getattr(config, "initializer_range", 0.02),
    )


def transformer_config(arch: ModelArch, tp: int, pp: int, dtype: torch.dtype,
                       use_cpu_initialization: bool):
    """The ``TransformerConfig`` for ``arch`` under a layout; fusions off so CPU and GPU agree."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
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
        use_cpu_initialization=use_cpu_initialization,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
    )
