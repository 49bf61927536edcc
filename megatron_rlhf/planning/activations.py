"""Activation, logits and KV-cache bytes, from a :class:`ModelArch` and a workload.

Two kernel sets. ``local`` is megatron-core's local layer spec, what runs on CPU (and on a GPU
without Transformer Engine), with torch's SDPA as core attention (its fused kernel keeps no
``s x s`` term; for MLA, whose q/k and v head sizes differ, SDPA's math path keeps the
probabilities); torch's RMSNorm keeps its input and the normalised input. Its counts are
derived from the tensors autograd saves and tested against saved-tensor hooks
(tests/test_planner_memory.py, within 15%). ``te`` is the GPU production path (Transformer
Engine, flash attention): Korthikanti et al. 2022, Table 2, as Megatron-LM's
``theoretical_memory_usage.py`` applies it (``18 + 4 f / h`` bytes per token and hidden unit per
layer in bf16, no ``s^2`` term), with the MLP term taken per routed expert for MoE layers. The
``te`` numbers were never measured here (no GPU); docs/planner.md says where each comes from.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rlhf.models.hf_config import ModelArch


@dataclass(frozen=True)
class Workload:
    """One micro-batch of one rank: ``batch`` rows of ``seq`` tokens, activations of
    ``element_bytes`` each (2: bf16, 4: fp32). ``packed``: the rows hold several sequences
    (``data.use_remove_padding``) and carry a dense ``[batch, 1, seq, seq]`` mask on the local
    spec; ``positions``: every token has its own RoPE position (shared prompts: a reply
    continues from its prompt's end), so RoPE's cos and sin are per token, not per column."""

    batch: int
    seq: int
    element_bytes: int = 2
    tp: int = 1
    sequence_parallel: bool = False
    packed: bool = False
    positions: bool = False


def _attention_local(arch: ModelArch, w: Workload, mode: str) -> float:
    """Elements per token the attention block keeps (local spec), norm included."""
    t = w.tp
    hs = arch.hidden_size / t if w.sequence_parallel else arch.hidden_size
    a = arch.num_attention_heads
    kept = 2 * hs + hs  # RMSNorm input and normalised input; the projection's input
    if arch.mla is None:
        d, g = arch.head_dim, arch.num_query_groups
        kept += (a + 2 * g) * d / t  # QKV output (RoPE reads its views)
        core_inputs, out = (a + 2 * g) * d / t, a * d / t
        q = k = a * d / t
        v = a * d / t  # repeated for GQA by the unfused attention
    else:
        m = arch.mla
        qh = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            kept += 3 * m.q_lora_rank  # down output, its norm's input and output
        kept += a * qh / t + m.kv_lora_rank + m.qk_rope_head_dim + 2 * m.kv_lora_rank
        kept += a * (m.qk_nope_head_dim + m.v_head_dim) / t  # up projection output
        q = k = a * qh / t
        v = a * m.v_head_dim / t
        core_inputs, out = q + k + v, a * m.v_head_dim / t
    if mode == "none" and arch.mla is None:
        # SDPA's fused kernel: RoPE's q and k (v is a view of the QKV output), its own output,
        # and a float32 log-sum-exp per head; no s x s term
        kept += q + g * d / t + a * d / t + a / t * 4 / w.element_bytes
    elif mode == "none":
        # MLA's q/k and v head sizes differ: SDPA takes its math path, which keeps the scaled q,
        # k and the s x s probabilities
        kept += q + k + v + a * w.seq / t
    else:
        kept += core_inputs  # what the recomputed core attention starts from
    return kept + out


def _mlp_local(arch: ModelArch, index: int, w: Workload) -> float:
    t = w.tp
    hs = arch.hidden_size / t if w.sequence_parallel else arch.hidden_size
    kept = 2 * hs + hs  # norm, fc1 input
    moe = arch.moe
    if moe is None or not moe.layer_pattern[index]:
        return kept + 4 * arch.ffn_hidden_size / t  # fc1 output (2f), SiLU output, product
    k, h = moe.topk, arch.hidden_size
    kept += 3 * moe.num_experts  # router logits, scores, top-k mask
    kept += k * (2 * h + 4 * moe.ffn_hidden_size + 1)  # permuted tokens, experts, unpermute
    if moe.shared_ffn_hidden_size:
        kept += 4 * moe.shared_ffn_hidden_size / t
    return kept


def _layer_te_bytes(arch: ModelArch, index: int, w: Workload) -> float:
    """Bytes per token per layer, Megatron-LM's formula (bf16, flash attention, SP)."""
    h, moe = arch.hidden_size, arch.moe
    if moe is None or not moe.layer_pattern[index]:
        ffn = 4 * arch.ffn_hidden_size
    else:
        ffn = 4 * moe.topk * moe.ffn_hidden_size + 4 * (moe.shared_ffn_hidden_size or 0) \
            + 4 * moe.topk * h  # routed tokens before and after the experts
    return h * 18 + ffn


def layer_bytes(arch: ModelArch, index: int, w: Workload, mode: str, kernels: str = "local") -> float:
    """Bytes layer ``index`` keeps for backward for one micro-batch (``mode``: none, selective
    or full recompute; full keeps only the layer's input)."""
    tokens = w.batch * w.seq
    hs = arch.hidden_size / w.tp if w.sequence_parallel or kernels == "te" else arch.hidden_size
    if mode == "full":
        return tokens * hs * w.element_bytes
    if kernels == "te":
        return tokens * _layer_te_bytes(arch, index, w) / w.tp
    elements = _attention_local(arch, w, mode) + _mlp_local(arch, index, w)
    rope = arch.mla.qk_rope_head_dim if arch.mla else arch.head_dim
    # RoPE's cos/sin for q and k: per column, or per token with positions of their own
    per_sequence = 4 * (tokens if w.positions else w.seq) * rope * w.element_bytes
    mask = w.seq * w.seq if mode == "none" and arch.mla else 0  # SDPA's math path: causal mask
    if w.packed and mode == "none" and not arch.mla:
        # SDPA's fused kernel gets the packed mask as an additive one: a copy in every layer
        mask = w.batch * w.seq * w.seq * w.element_bytes
    return tokens * elements * w.element_bytes + per_sequence + mask + _fp32_softmax(arch, w, mode)


def _packed_once_bytes(arch: ModelArch, w: Workload, mode: str) -> float:
    """What a packed micro-batch keeps once, whatever the layer count, when layers recompute
    (selective or full): the boolean mask (a checkpoint's input) and, under full recompute,
    the per-token RoPE frequencies handed to the checkpointed layers (float32)."""
    if not w.packed or mode == "none":
        return 0.0
    rope = 0.0
    if mode == "full" and w.positions and not arch.mla:
        rope = w.batch * w.seq * arch.head_dim * 4.0
    return w.batch * w.seq * w.seq + rope


def _fp32_softmax(arch: ModelArch, w: Workload, mode: str) -> float:
    """The unfused softmax of half-precision scores runs in fp32 (megatron's
    ``attention_softmax_in_fp32``, on by default) and keeps its fp32 output for backward beside
    the bf16 probabilities: 4 more bytes per score. Missing, the plan of a bf16 training step on
    an H200 was 25-35% short of ``torch.cuda.max_memory_allocated`` (docs/benchmarks.md)."""
    if mode != "none" or w.element_bytes >= 4 or arch.mla is None:  # SDPA's fused kernel: none
        return 0.0
    return w.batch * w.seq * arch.num_attention_heads / w.tp * w.seq * 4.0


def decoder_saved_bytes(arch: ModelArch, w: Workload, mode: str, layers: range | None = None,
                        kernels: str = "local", final_norm: bool = True) -> float:
    """What the decoder (``layers``, default all; the final norm on the last stage) keeps for
    backward for one micro-batch."""
    layers = range(arch.num_layers) if layers is None else layers
    total = sum(layer_bytes(arch, i, w, mode, kernels) for i in layers)
    if kernels == "local" and len(layers):
        total += _packed_once_bytes(arch, w, mode)
    if final_norm:
        total += 2 * w.batch * w.seq * arch.hidden_size * w.element_bytes
    return total


def recompute_working_bytes(arch: ModelArch, w: Workload, mode: str, layers: range,
                            kernels: str = "local") -> float:
    """Full recompute rebuilds one layer's activations at a time in backward: the largest one
    of the stage is live on top of what the forward kept."""
    if mode != "full" or not len(layers):
        return 0.0
    return max(layer_bytes(arch, i, w, "none" if kernels == "local" else "selective", kernels)
               for i in layers)


def logits_bytes(arch: ModelArch, w: Workload, padded_vocab: int) -> float:
    """The last stage's output layer for one micro-batch: the logits (activation dtype), their
    fp32 copy and the fp32 softmax the cross-entropy keeps for backward (full vocabulary; the
    RL update's lean path, ``actor.logprob_chunk_tokens``, keeps none of this: an upper bound there)."""
    if arch.kind == "value":
        return w.batch * w.seq * 4.0
    return w.batch * w.seq * padded_vocab / w.tp * (w.element_bytes + 8)


def kv_bytes_per_token(arch: ModelArch, element_bytes: int, tp: int = 1) -> float:
    """KV cache per token on one GPU of an engine of ``tp`` GPUs: K and V of the KV heads,
    split over TP (replicated when there are fewer heads than GPUs); for MLA the compressed
    latent and the shared RoPE key (``kv_lora_rank + qk_rope_head_dim`` per layer) on every
    rank, which is what SGLang's MLA token pool and transformers' cache (the ``hf`` engine)
    both keep."""
    layers = arch.num_layers
    if arch.mla is not None:
        return layers * (arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim) * element_bytes
    groups = max(arch.num_query_groups / tp, 1)
    return layers * 2 * groups * arch.head_dim * element_bytes
