"""Tiny Hugging Face models and tokenizers built offline: the embedded default for demos and tests.

Nothing is downloaded: the tokenizer is a byte-level BPE trained in well under a second on text we
pass in, and the models are random ``Qwen2``/``Llama`` configs whose norm weights and biases are
perturbed away from their init values (1 and 0), so parity tests really exercise them.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
# CHAT_TEMPLATE that also carries tools, Qwen-style: the tools' names in a system turn, calls in
# the hermes format, tool messages as turns of their own (what ``rollout.tools`` needs).
TOOL_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t.function.name }}{% endfor %}; call "
    "as <tool_call>{json}</tool_call><|end|>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def train_tokenizer(texts: list[str], out_dir: str | os.PathLike, vocab_size: int = 300,
                    chat_template: bool | str = True):
    """Train and save a byte-level BPE tokenizer loadable with ``AutoTokenizer``;
    ``chat_template``: True for :data:`CHAT_TEMPLATE`, or a template's text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    # Digits split one per token, as Llama 3 and Qwen2 do: arithmetic stays learnable.
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|pad|>",
                                        eos_token="<|end|>")
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE if chat_template is True else chat_template
    tokenizer.save_pretrained(out_dir)
    return tokenizer


_CONFIGS = {"qwen2": "Qwen2Config", "llama": "LlamaConfig", "qwen3": "Qwen3Config",
            "qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig",
            "deepseek_v3": "DeepseekV3Config"}
_PREFIXES = {"qwen2": "Qwen2", "llama": "Llama", "qwen3": "Qwen3", "qwen2_moe": "Qwen2Moe",
             "qwen3_moe": "Qwen3Moe", "deepseek_v3": "DeepseekV3"}


def _family_extras(family: str, hidden_size: int, num_layers: int) -> dict:
    """What a tiny model of ``family`` adds to the common fields: experts, MLA, RoPE scaling."""
    moe = dict(moe_intermediate_size=hidden_size // 2, num_experts_per_tok=2)
    if family == "qwen3":
        return dict(head_dim=hidden_size // 4)
    if family == "qwen2_moe":  # a shared expert with its gate; the last layer dense
        return dict(moe, num_experts=4, shared_expert_intermediate_size=hidden_size,
                    norm_topk_prob=False, mlp_only_layers=[num_layers - 1])
    if family == "qwen3_moe":
        return dict(moe, num_experts=4, norm_topk_prob=True, head_dim=hidden_size // 4)
    if family == "deepseek_v3":  # first layer dense, 8 experts in 4 groups of which 1 is kept
        return dict(moe, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
                    n_group=4, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                    q_lora_rank=hidden_size // 2, kv_lora_rank=hidden_size // 4,
                    qk_nope_head_dim=hidden_size // 4, qk_rope_head_dim=hidden_size // 8,
                    v_head_dim=hidden_size // 4, num_key_value_heads=4)  # MLA: a KV head per head
    return {}


def tiny_config(family: str = "qwen2", kind: str = "policy", vocab_size: int = 250,
                tie_word_embeddings: bool = False, num_layers: int = 4, hidden_size: int = 64,
                num_kv_heads: int = 2, pad_token_id: int | None = None, **overrides):
    """A small config of ``family`` (see ``_CONFIGS``) as a causal LM or a 1-label classifier;
    ``overrides`` replace any field (``q_lora_rank=None``, ``rope_parameters={...}``)."""
    import transformers

    config_class = getattr(transformers, _CONFIGS[family])
    suffix = "ForCausalLM" if kind == "policy" else "ForSequenceClassification"
    fields = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=num_kv_heads,
        max_position_embeddings=256, tie_word_embeddings=tie_word_embeddings,
        rope_theta=500000.0 if family == "llama" else 10000.0, rms_norm_eps=1e-6,
        num_labels=1, pad_token_id=pad_token_id, architectures=[_PREFIXES[family] + suffix])
    fields.update(_family_extras(family, hidden_size, num_layers))
    fields.update(overrides)
    return config_class(**fields)


def make_tiny_model(config, out_dir: str | os.PathLike | None = None, seed: int = 0):
    """Instantiate ``config`` with perturbed norms/biases; save it to ``out_dir`` if given."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(seed)
    arch = config.architectures[0]
    auto = AutoModelForCausalLM if arch.endswith("ForCausalLM") else AutoModelForSequenceClassification
    model = auto.from_config(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.add_(0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
            elif name == "score.weight":
                param.normal_(0.0, 0.5)
            elif name.endswith("mlp.gate.weight"):  # decisive routing: no near-ties in top-k
                param.normal_(0.0, 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    if out_dir is not None:
        model.save_pretrained(Path(out_dir))
    return model


def make_tiny_base(out_dir: str | os.PathLike, texts: list[str], vocab_size: int = 400,
                   num_layers: int = 4, hidden_size: int = 128, seed: int = 0,
                   family: str = "qwen2", chat_template: str = CHAT_TEMPLATE) -> Path:
    """A random tiny causal LM of ``family`` with a tokenizer trained on ``texts``: the demo's
    base model (Qwen2), or any supported family's for tests; ``chat_template``: the tokenizer's
    (:data:`TOOL_TEMPLATE` for a policy that calls tools)."""
    out = Path(out_dir)
    tokenizer = train_tokenizer(texts, out, vocab_size=vocab_size, chat_template=chat_template)
    config = tiny_config(family, "policy", vocab_size=len(tokenizer), num_layers=num_layers,
                         hidden_size=hidden_size, pad_token_id=tokenizer.pad_token_id)
    config.eos_token_id = tokenizer.eos_token_id
    make_tiny_model(config, out, seed=seed)
    return out
