"""Hugging Face config -> :class:`ModelArch`: what a Megatron model needs, read and checked once.

Families: Qwen2 / Qwen2.5 (QKV bias), Llama (incl. Llama 3.x ``rope_type: llama3``), Qwen3 (QK
norm), Qwen2-MoE (shared expert with a sigmoid gate), Qwen3-MoE, and DeepSeek-V3 (multi-latent
attention, sigmoid router with expert bias, group-limited routing, routed scaling, shared
experts, first-k dense layers), each as ``*ForCausalLM`` (policy) or ``*ForSequenceClassification``
with one label (value/reward model). A config the project cannot reproduce exactly is refused
here with one line naming the field, never silently approximated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_rlhf.distributed.layout import ModelShape
from megatron_rlhf.errors import UserError

SUPPORTED_FAMILIES = ("qwen2", "llama", "qwen3", "qwen2_moe", "qwen3_moe", "deepseek_v3")
VOCAB_PAD_MULTIPLE = 128


@dataclass(frozen=True)
class MoEArch:
    """Mixture-of-experts layers (megatron-core's router semantics)."""

    num_experts: int
    topk: int
    ffn_hidden_size: int  # per routed expert
    layer_pattern: tuple[int, ...]  # per layer: 1 = MoE, 0 = dense (``ModelArch.ffn_hidden_size``)
    shared_ffn_hidden_size: int = 0  # all shared experts together; 0 = none
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(gate(x)) scales the shared expert
    score_function: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
    pre_softmax: bool = False  # softmax over all experts before top-k, no renormalisation
    expert_bias: bool = False  # DeepSeek-V3 e_score_correction_bias (aux-loss-free balancing)
    num_groups: int | None = None  # group-limited routing
    group_topk: int | None = None
    scaling_factor: float | None = None  # routed_scaling_factor


@dataclass(frozen=True)
class MLAArch:
    """DeepSeek multi-latent attention; ``q_lora_rank=None`` projects queries directly."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class RopeScaling:
    """``llama3`` (Llama 3.1+) or ``yarn`` (DeepSeek-V3) frequency scaling."""

    kind: str
    factor: float
    original_max_position_embeddings: int
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class ModelArch:
    """What a Megatron model needs from an HF config, checked once."""

    family: str  # one of SUPPORTED_FAMILIES
    kind: str  # "policy" (LM head) | "value" (scalar head)
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int  # dense layers
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
    qk_norm: bool = False
    moe: MoEArch | None = None
    mla: MLAArch | None = None
    rope_scaling: RopeScaling | None = None
    mtp_layers: int = 0  # DeepSeek-V3 multi-token prediction: in the checkpoint, never built

    @property
    def shape(self) -> ModelShape:
        return ModelShape(self.num_layers, self.num_attention_heads, self.num_query_groups,
                          self.vocab_size, self.moe.num_experts if self.moe else 0)


def padded_vocab_size(vocab_size: int, tp: int = 1) -> int:
    """Round the vocab up so every TP size dividing 128 (and ``tp``) splits it evenly.

    The padded size is fixed once per checkpoint, so one checkpoint loads under any such TP.
    """
    multiple = VOCAB_PAD_MULTIPLE * tp // math.gcd(VOCAB_PAD_MULTIPLE, tp)
    return -(-vocab_size // multiple) * multiple


def _rope(config, family: str) -> tuple[float, RopeScaling | None]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise UserError("the Hugging Face config has no rope_theta")
    if rope_type == "default":
        return float(theta), None
    allowed = {"llama": "llama3", "deepseek_v3": "yarn"}.get(family)
    if rope_type != allowed:
        raise UserError(f"unsupported rope_type {rope_type!r} for {family} in the Hugging Face "
                        f"config's rope_parameters (supported: default{', ' + allowed if allowed else ''})")
    try:
        if rope_type == "llama3":
            scaling = RopeScaling("llama3", float(params["factor"]),
                                  int(params["original_max_position_embeddings"]),
                                  low_freq_factor=float(params["low_freq_factor"]),
                                  high_freq_factor=float(params["high_freq_factor"]))
        else:
            scaling = RopeScaling("yarn", float(params["factor"]),
                                  int(params["original_max_position_embeddings"]),
                                  beta_fast=float(params.get("beta_fast", 32.0)),
                                  beta_slow=float(params.get("beta_slow", 1.0)),
                                  mscale=float(params.get("mscale", 1.0)),
                                  mscale_all_dim=float(params.get("mscale_all_dim", 0.0)))
    except KeyError as err:
        raise UserError(f"rope_parameters of type {rope_type!r} lack {err.args[0]!r}") from None
    return float(theta), scaling


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


def _sparse_pattern(config, layers: int) -> tuple[int, ...]:
    """Qwen MoE: layer i is MoE unless listed in ``mlp_only_layers``, every ``decoder_sparse_step``."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    return tuple(int(i not in dense and (i + 1) % step == 0) for i in range(layers))


def _qwen_moe(config, layers: int) -> MoEArch:
    shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    return MoEArch(num_experts=int(experts), topk=int(config.num_experts_per_tok),
                   ffn_hidden_size=int(config.moe_intermediate_size),
                   layer_pattern=_sparse_pattern(config, layers), shared_ffn_hidden_size=shared,
                   shared_expert_gate=shared > 0,
                   # HF: softmax over all experts, top-k, renormalised iff norm_topk_prob.
                   # megatron: pre_softmax=False takes the top-k logits and softmaxes them.
                   pre_softmax=not getattr(config, "norm_topk_prob", False))


def _deepseek_moe(config, layers: int) -> MoEArch:
    scoring = getattr(config, "scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise UserError(f"deepseek_v3 with scoring_func={scoring!r}: only sigmoid is supported")
    if not getattr(config, "norm_topk_prob", True):
        raise UserError("deepseek_v3 with norm_topk_prob=false: megatron-core always renormalises "
                        "sigmoid top-k scores")
    topk, groups, group_topk = config.num_experts_per_tok, config.n_group, config.topk_group
    if groups and groups > 1 and topk != 2 * group_topk:
        # HF scores a group by its top-2 experts, megatron by its top (topk // group_topk).
        raise UserError(f"deepseek_v3 with num_experts_per_tok={topk} and topk_group={group_topk}: "
                        "group-limited routing is reproduced exactly only when "
                        "num_experts_per_tok == 2 * topk_group")
    first_dense = int(getattr(config, "first_k_dense_replace", 0) or 0)
    shared = int(getattr(config, "n_shared_experts", 0) or 0) * int(config.moe_intermediate_size)
    return MoEArch(num_experts=int(config.n_routed_experts), topk=int(topk),
                   ffn_hidden_size=int(config.moe_intermediate_size),
                   layer_pattern=tuple(int(i >= first_dense) for i in range(layers)),
                   shared_ffn_hidden_size=shared, score_function="sigmoid", expert_bias=True,
                   num_groups=int(groups) if groups and groups > 1 else None,
                   group_topk=int(group_topk) if groups and groups > 1 else None,
                   scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0))


def _deepseek_mla(config) -> MLAArch:
    if not getattr(config, "rope_interleave", True):
        raise UserError("deepseek_v3 with rope_interleave=false is not supported (megatron's MLA "
                        "expects the interleaved rotary layout of the released checkpoints)")
    return MLAArch(q_lora_rank=getattr(config, "q_lora_rank", None) or None,
                   kv_lora_rank=int(config.kv_lora_rank),
                   qk_nope_head_dim=int(config.qk_nope_head_dim),
                   qk_rope_head_dim=int(config.qk_rope_head_dim), v_head_dim=int(config.v_head_dim))


def _check_common(config, family: str) -> None:
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UserError(f"unsupported hidden_act {config.hidden_act!r} (expected silu)")
    if getattr(config, "mlp_bias", False):
        raise UserError("unsupported: mlp_bias=True")
    if family in ("llama", "qwen3", "qwen3_moe", "deepseek_v3") and getattr(config, "attention_bias", False):
        raise UserError(f"unsupported: {family} attention_bias=True")
    if getattr(config, "use_sliding_window", False):
        raise UserError("unsupported: use_sliding_window=True")


def arch_from_hf_config(config) -> ModelArch:
    """Read and check an HF ``PretrainedConfig``; raises :class:`UserError` if unsupported."""
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise UserError(f"unsupported model_type {family!r}: supported are "
                        f"{', '.join(SUPPORTED_FAMILIES)}")
    _check_common(config, family)
    heads, layers = config.num_attention_heads, config.num_hidden_layers
    kind = _model_kind(config)
    theta, scaling = _rope(config, family)
    moe = mla = None
    if family in ("qwen2_moe", "qwen3_moe"):
        moe = _qwen_moe(config, layers)
    elif family == "deepseek_v3":
        moe, mla = _deepseek_moe(config, layers), _deepseek_mla(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelArch(
        family=family,
        kind=kind,
        num_layers=layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_attention_heads=heads,
        # MLA has no key/value groups: every head has its own keys and values.
        num_query_groups=heads if mla else (getattr(config, "num_key_value_heads", None) or heads),
        head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim if mla else head_dim,
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=theta,
        qkv_bias=family == "qwen2" or (family == "qwen2_moe" and bool(getattr(config, "qkv_bias", True))),
        # A reward model's scalar head is never tied to the embedding.
        tie_word_embeddings=kind == "policy" and bool(getattr(config, "tie_word_embeddings", False)),
        initializer_range=getattr(config, "initializer_range", 0.02),
        qk_norm=family in ("qwen3", "qwen3_moe") or mla is not None,
        moe=moe,
        mla=mla,
        rope_scaling=scaling,
        mtp_layers=int(getattr(config, "num_nextn_predict_layers", 0) or 0) if mla else 0,
    )
