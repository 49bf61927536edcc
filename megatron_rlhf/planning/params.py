"""Parameter counts, per model and per rank, from a :class:`ModelArch` alone (no weights).

:func:`rank_tensors` lists the parameters one rank holds, in the order megatron-core registers
them: exactly what :func:`megatron_rlhf.models.builder.build_model` allocates for that rank
(tested against meta-device builds of every family at layouts of up to 64 ranks). With
Transformer Engine's layer specs (``te=True``) only MLA's two down projections differ: TE
replicates them on every TP rank, the local spec splits them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from megatron_rlhf.distributed.layout import ParallelLayout
from megatron_rlhf.models.hf_config import ModelArch, padded_vocab_size

PARTS = ("embedding", "attention", "dense_mlp", "experts", "shared_experts", "router", "norms",
         "output")


@dataclass(slots=True)  # not frozen: a plan builds millions; frozen init costs twice as much
class Tensor:
    """One parameter of one rank."""

    name: str
    numel: int
    part: str  # one of PARTS
    expert: bool = False  # a routed expert's: reduced over the expert data-parallel group
    shared_embedding: bool = False  # tied embedding on a pipeline end: its own DDP bucket
    shape: tuple[int, int] | None = None  # a linear's weight: (out, in) on this rank
    frozen: bool = False  # held, not trained (a LoRA run's base): no gradient, no optimizer state


def _as(t: Tensor, name: str, frozen: bool | None = None) -> Tensor:
    """``t`` renamed (and frozen or not): ``dataclasses.replace`` at a third of the cost, which
    counts when a plan builds every tensor of a 671B model for each of a hundred layouts."""
    return Tensor(name, t.numel, t.part, t.expert, t.shared_embedding, t.shape,
                  t.frozen if frozen is None else frozen)


def _linear(name: str, out: int, inp: int, part: str, bias: bool = False, **kw) -> list[Tensor]:
    items = [Tensor(f"{name}.weight", out * inp, part, shape=(out, inp), **kw)]
    return items + ([Tensor(f"{name}.bias", out, part, **kw)] if bias else [])


def with_lora(tensors: list[Tensor], rank: int, targets: tuple[str, ...],
              value_head: bool = False) -> list[Tensor]:
    """A LoRA run's parameters on one rank: every base tensor frozen (``value_head``: a value
    model's scalar head trains), and after each targeted linear (its weight, then its bias) its
    adapter's ``A`` ``[rank, in]`` and ``B`` ``[out, rank]`` of this rank's weight shape (a
    column-parallel base's split rows go to ``B``, a row-parallel one's split columns to ``A``),
    in megatron's registration order; a routed expert's adapter is an expert parameter."""
    after: dict[str, list[Tensor]] = {}  # tensor name -> the adapter registered right after it
    names = {t.name for t in tensors}
    for t in tensors:
        leaf = t.name.rsplit(".", 2)[-2] if t.shape is not None else None
        if leaf in targets:
            module = t.name.removesuffix(".weight")
            adapter = [Tensor(f"{module}.adapter.lora_a", rank * t.shape[1], t.part, t.expert),
                       Tensor(f"{module}.adapter.lora_b", t.shape[0] * rank, t.part, t.expert)]
            after[f"{module}.bias" if f"{module}.bias" in names else t.name] = adapter
    out = []
    for t in tensors:
        out.append(_as(t, t.name, frozen=not (value_head and t.name == "output_layer.weight")))
        out += after.get(t.name, [])
    return out


def _attention(arch: ModelArch, tp: int, te: bool) -> list[Tensor]:
    return [_as(t, f"self_attention.{t.name}") for t in _attention_tensors(arch, tp, te)]


def _attention_tensors(arch: ModelArch, tp: int, te: bool) -> list[Tensor]:
    h, heads, a = arch.hidden_size, arch.num_attention_heads, "attention"
    if arch.mla is None:
        d, groups = arch.head_dim, arch.num_query_groups
        items = _linear("linear_proj", h, heads * d // tp, a)
        items += _linear("linear_qkv", (heads + 2 * groups) * d // tp, h, a, bias=arch.qkv_bias)
        if arch.qk_norm:
            items += [Tensor("q_layernorm.weight", d, "norms"), Tensor("k_layernorm.weight", d, "norms")]
        return items
    m = arch.mla
    q_head = m.qk_nope_head_dim + m.qk_rope_head_dim
    down = 1 if te else tp  # TE replicates the down projections; the local spec splits them
    items = _linear("linear_proj", h, heads * m.v_head_dim // tp, a)
    if m.q_lora_rank:
        items += _linear("linear_q_down_proj", m.q_lora_rank // down, h, a)
        items += _linear("linear_q_up_proj", heads * q_head // tp, m.q_lora_rank, a)
    else:
        items += _linear("linear_q_proj", heads * q_head // tp, h, a)
    items += _linear("linear_kv_down_proj", (m.kv_lora_rank + m.qk_rope_head_dim) // down, h, a)
    items += _linear("linear_kv_up_proj", heads * (m.qk_nope_head_dim + m.v_head_dim) // tp,
                     m.kv_lora_rank, a)
    if m.q_lora_rank:
        items.append(Tensor("q_layernorm.weight", m.q_lora_rank, "norms"))
    return items + [Tensor("kv_layernorm.weight", m.kv_lora_rank, "norms")]


def _mlp(prefix: str, hidden: int, ffn: int, split: int, part: str, **kw) -> list[Tensor]:
    """A gated (SwiGLU) MLP's two matrices on one of ``split`` tensor-parallel ranks."""
    return (_linear(f"{prefix}.linear_fc1", 2 * (ffn // split), hidden, part, **kw)
            + _linear(f"{prefix}.linear_fc2", hidden, ffn // split, part, **kw))


def layer_tensors(arch: ModelArch, index: int, layout: ParallelLayout, te: bool = False) -> list[Tensor]:
    """Layer ``index`` (global) on one rank of ``layout``."""
    h, tp, moe = arch.hidden_size, layout.tp, arch.moe
    items = [Tensor("input_layernorm.weight", h, "norms"), *_attention(arch, tp, te),
             Tensor("pre_mlp_layernorm.weight", h, "norms")]
    if moe is None or not moe.layer_pattern[index]:
        return items + _mlp("mlp", h, arch.ffn_hidden_size, tp, "dense_mlp")
    items += _linear("mlp.router", moe.num_experts, h, "router")
    for expert in range(moe.num_experts // layout.ep):
        items += _mlp(f"mlp.experts.local_experts.{expert}", h, moe.ffn_hidden_size, layout.etp,
                      "experts", expert=True)
    if moe.shared_ffn_hidden_size:
        if moe.shared_expert_gate:
            items.append(Tensor("mlp.shared_experts.gate_weight", h, "shared_experts"))
        items += _mlp("mlp.shared_experts", h, moe.shared_ffn_hidden_size, tp, "shared_experts")
    return items


def rank_tensors(arch: ModelArch, layout: ParallelLayout, stage: int, te: bool = False,
                 padded_vocab: int | None = None) -> list[Tensor]:
    """Every parameter one rank of pipeline stage ``stage`` holds (every TP and EP rank of a
    stage holds the same sizes), in megatron-core's order."""
    vocab = padded_vocab or padded_vocab_size(arch.vocab_size, layout.tp)
    h, last = arch.hidden_size, stage == layout.pp - 1
    tied_copy = arch.kind == "policy" and arch.tie_word_embeddings and layout.pp > 1
    items = []
    if stage == 0:
        items.append(Tensor("embedding.word_embeddings.weight", vocab // layout.tp * h, "embedding",
                            shared_embedding=tied_copy))
    first, count = layout.stage_of(arch.num_layers, stage)
    for index in range(first, first + count):
        items += [_as(t, f"decoder.layers.{index - first}.{t.name}")
                  for t in layer_tensors(arch, index, layout, te)]
    if last:
        items.append(Tensor("decoder.final_layernorm.weight", h, "norms"))
        if arch.kind == "value":
            items.append(Tensor("output_layer.weight", h, "output"))  # the scalar head
        elif not arch.tie_word_embeddings or layout.pp > 1:
            items.append(Tensor("output_layer.weight", vocab // layout.tp * h, "output",
                                shared_embedding=tied_copy))
    return items


@dataclass(frozen=True)
class RankParams:
    """The parameters one rank holds, by part (counts, not bytes)."""

    parts: dict

    @classmethod
    def of(cls, tensors: list[Tensor]) -> "RankParams":
        counts = Counter()
        for t in tensors:
            counts[t.part] += t.numel
        return cls({part: counts.get(part, 0) for part in PARTS})

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def experts(self) -> int:
        return self.parts["experts"]


def stage_params(arch: ModelArch, layout: ParallelLayout, stage: int, te: bool = False,
                 padded_vocab: int | None = None) -> RankParams:
    return RankParams.of(rank_tensors(arch, layout, stage, te, padded_vocab))


def model_params(arch: ModelArch) -> int:
    """All parameters of the model as Hugging Face counts them (vocabulary unpadded, a tied
    embedding once, multi-token-prediction layers excluded)."""
    return stage_params(arch, ParallelLayout(), 0, padded_vocab=arch.vocab_size).total


def active_params(arch: ModelArch) -> int:
    """The parameters one token passes through: embedding and output layer, attention, dense
    MLPs, and in each MoE layer its router, shared experts and ``topk`` routed experts."""
    whole = stage_params(arch, ParallelLayout(), 0, padded_vocab=arch.vocab_size)
    if arch.moe is None:
        return whole.total
    per_expert = 3 * arch.hidden_size * arch.moe.ffn_hidden_size
    return whole.total - whole.experts + sum(arch.moe.layer_pattern) * arch.moe.topk * per_expert
