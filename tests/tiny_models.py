"""The tiny models every test shares: made once per session, offline, in seconds."""

from __future__ import annotations

from pathlib import Path

from megatron_rlhf.models.tiny import TOOL_TEMPLATE, make_tiny_model, tiny_config, train_tokenizer

TEXTS = [f"what is {a} plus {b}? the answer is {a + b}." for a in range(40) for b in range(12)]

# name -> (family, kind, tied embeddings, kv heads)
MODELS = {
    "qwen2_policy": ("qwen2", "policy", False, 2),  # GQA, QKV bias, untied
    "llama_policy": ("llama", "policy", True, 4),  # tied embeddings, 4 KV heads so TP=4 is valid
    "qwen2_rm": ("qwen2", "value", False, 2),
    "llama_rm": ("llama", "value", True, 2),  # tie flag must be ignored for the scalar head
    "qwen2_tied": ("qwen2", "policy", True, 4),  # Qwen2 tied (Qwen2.5-0.5B's way), at TP=4 too
}
POLICY_VOCAB = 250  # not a multiple of 4: padded to 256 in Megatron
# name -> (family, kind, tiny_config overrides): a mixture-of-experts reward model of 3 layers
# (no pipeline size above 1 divides them)
MOE_MODELS = {"qwen3_moe_rm": ("qwen3_moe", "value", {"num_layers": 3})}


def build_all(root: str | Path) -> dict[str, Path]:
    """Write every tiny model (and the shared tokenizer) under ``root``; return name -> folder."""
    root = Path(root)
    tokenizer = train_tokenizer(TEXTS, root / "tokenizer", vocab_size=301)
    paths = {}
    for index, (name, (family, kind, tied, kv_heads)) in enumerate(MODELS.items()):
        vocab = POLICY_VOCAB if kind == "policy" else len(tokenizer)
        config = tiny_config(family, kind, vocab_size=vocab, tie_word_embeddings=tied,
                             num_kv_heads=kv_heads, pad_token_id=tokenizer.pad_token_id)
        paths[name] = root / name
        make_tiny_model(config, paths[name], seed=index)
        if kind == "value":
            tokenizer.save_pretrained(paths[name])
    for index, (name, (family, kind, overrides)) in enumerate(MOE_MODELS.items()):
        config = tiny_config(family, kind, vocab_size=len(tokenizer),
                             pad_token_id=tokenizer.pad_token_id, **overrides)
        paths[name] = root / name
        make_tiny_model(config, paths[name], seed=100 + index)
        tokenizer.save_pretrained(paths[name])
    return paths


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
DSV3_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
             "original_max_position_embeddings": 64}
# name -> (family, tiny_config overrides): the 2026 families, 4 layers (PP=2 splits them)
FAMILY_MODELS = {
    "qwen3": ("qwen3", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v3_no_q_lora": ("deepseek_v3", {"q_lora_rank": None}),
    "deepseek_v3_yarn": ("deepseek_v3", {"rope_parameters": DSV3_YARN}),
    "llama3_rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    # Layer counts no pipeline size divides: uneven first/last stages.
    "qwen3_moe_3l": ("qwen3_moe", {"num_layers": 3}),
    "deepseek_v3_5l": ("deepseek_v3", {"num_layers": 5}),
}


def build_families(root: str | Path) -> dict[str, Path]:
    """A tiny policy of every family in FAMILY_MODELS under ``root``; name -> folder."""
    root = Path(root)
    tokenizer = train_tokenizer(TEXTS, root / "tokenizer", vocab_size=301)
    paths = {}
    for index, (name, (family, overrides)) in enumerate(FAMILY_MODELS.items()):
        config = tiny_config(family, "policy", vocab_size=POLICY_VOCAB,
                             pad_token_id=tokenizer.pad_token_id, **overrides)
        paths[name] = root / name
        make_tiny_model(config, paths[name], seed=10 + index)
        tokenizer.save_pretrained(paths[name])
    return paths


def build_task_workspace(root: str | Path, train: int, val: int, seed: int, high: int = 19,
                         family: str = "qwen2") -> Path:
    """Bundled-task Parquet files under ``root/data`` and a tiny base LM under ``root/base``."""
    import pyarrow.parquet as pq

    from megatron_rlhf.data.task_files import write_task_files
    from megatron_rlhf.models.tiny import make_tiny_base

    root = Path(root)
    write_task_files(str(root / "data"), train=train, val=val, seed=seed, high=high)
    table = pq.read_table(root / "data" / "sft_train.parquet")
    texts = [p + " " + r for p, r in zip(table.column("prompt").to_pylist(),
                                         table.column("response").to_pylist())]
    make_tiny_base(root / "base", texts, hidden_size=64, num_layers=4, family=family)
    return root


TOOL_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
TOOL_ANSWER = "The answer is 42."


def build_tool_caller(out: str | Path, answer_margin: float = 0.0, scale: float = 30.0) -> Path:
    """A tiny Qwen2 policy that calls a tool, deterministically enough to test against.

    Its attention and MLP outputs are zeroed, so its next token depends on the last one alone
    (a bigram table we write into the embeddings and the head): after the generation prompt
    ``<|assistant|>`` it writes :data:`TOOL_CALL` or :data:`TOOL_ANSWER` (each one added token,
    so its ids are the tokenizer's own), the answer's logit ``answer_margin`` below the call's
    (0: a coin flip at temperature 1; > 0: greedy always calls), then ``<|end|>``. Other tokens
    are followed by near-uniform noise. Training moves it only slowly (logits of ``scale``)."""
    import torch

    out = Path(out)
    tokenizer = train_tokenizer(TEXTS, out, vocab_size=301, chat_template=False)
    tokenizer.add_tokens([TOOL_CALL, TOOL_ANSWER])
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.save_pretrained(out)
    config = tiny_config("qwen2", "policy", vocab_size=len(tokenizer), num_layers=2,
                         pad_token_id=tokenizer.pad_token_id)
    config.eos_token_id = tokenizer.eos_token_id
    model = make_tiny_model(config, seed=3)
    prompt, call, answer = (tokenizer.convert_tokens_to_ids(t)
                            for t in ("<|assistant|>", TOOL_CALL, TOOL_ANSWER))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        # Token k of (prompt, call, answer) enters as unit vector k: the final RMSNorm makes it
        # sqrt(hidden) * norm_weight[k] * e_k, whatever came before.
        unit = [config.hidden_size ** 0.5 * float(model.model.norm.weight[k]) for k in range(3)]
        for k, token in enumerate((prompt, call, answer)):
            embed[token].zero_()
            embed[token, k] = 1.0
        head.zero_()
        head[call, 0] = scale / unit[0]
        head[answer, 0] = (scale - answer_margin) / unit[0]
        head[tokenizer.eos_token_id, 1] = scale / unit[1]
        head[tokenizer.eos_token_id, 2] = scale / unit[2]
    model.save_pretrained(out)
    return out
