"""The HF <-> Megatron parameter map: exact inverses, against a slow per-head reference."""

import pytest
import torch

from megatron_rlhf.convert import mapping
from megatron_rlhf.models.hf_config import ModelArch, padded_vocab_size

ARCH = ModelArch(family="qwen2", kind="policy", num_layers=2, hidden_size=32, ffn_hidden_size=48,
                 num_attention_heads=8, num_query_groups=2, head_dim=4, vocab_size=250,
                 max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1e4, qkv_bias=True,
                 tie_word_embeddings=False, initializer_range=0.02)


def _rule(name):
    return mapping.rule_for(name, ARCH, 256, lambda j: j + 5)


def test_qkv_interleave_matches_per_group_loop():
    rule = _rule("decoder.layers.0.self_attention.linear_qkv.weight")
    assert rule.hf_names[0] == "model.layers.5.self_attn.q_proj.weight"  # offset applied
    q, k, v = torch.randn(32, 32), torch.randn(8, 32), torch.randn(8, 32)
    full = rule.merge([q, k, v])
    # Reference: for each KV group, its 4 query heads, then its key head, then its value head.
    rows = []
    for g in range(2):
        rows += [q[(g * 4 + h) * 4:(g * 4 + h + 1) * 4] for h in range(4)]
        rows += [k[g * 4:(g + 1) * 4], v[g * 4:(g + 1) * 4]]
    assert torch.equal(full, torch.cat(rows))
    assert all(torch.equal(a, b) for a, b in zip(rule.split(full), (q, k, v)))


def test_qkv_bias_round_trip():
    rule = _rule("decoder.layers.1.self_attention.linear_qkv.bias")
    parts = [torch.randn(32), torch.randn(8), torch.randn(8)]
    assert all(torch.equal(a, b) for a, b in zip(rule.split(rule.merge(parts)), parts))


@pytest.mark.parametrize("cut, shape", [(mapping.ROWS, (8, 6)), (mapping.COLS, (6, 8)),
                                        (mapping.GLU_ROWS, (16, 3)), (mapping.REPLICATED, (5,))])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_shard_unshard_inverse(cut, shape, tp):
    full = torch.randn(*shape)
    shards = [mapping.tp_shard(full, cut, rank, tp) for rank in range(tp)]
    assert all(s.is_contiguous() for s in shards)
    assert torch.equal(mapping.tp_unshard(shards, cut), full)


def test_glu_shard_holds_gate_and_up_halves():
    gate, up = torch.arange(8.0).reshape(8, 1), 100 + torch.arange(8.0).reshape(8, 1)
    shard = mapping.tp_shard(torch.cat([gate, up]), mapping.GLU_ROWS, 1, 2)
    assert torch.equal(shard, torch.cat([gate[4:], up[4:]]))


def test_vocab_padding_added_and_removed():
    assert padded_vocab_size(250) == 256 and padded_vocab_size(250, tp=3) == 384
    rule = _rule("embedding.word_embeddings.weight")
    table = torch.randn(250, 32)
    padded = rule.merge([table])
    assert padded.shape == (256, 32) and torch.count_nonzero(padded[250:]) == 0
    assert torch.equal(rule.split(padded)[0], table)


def test_tied_output_layer_reads_embedding():
    tied = ModelArch(**{**ARCH.__dict__, "tie_word_embeddings": True})
    rule = mapping.rule_for("output_layer.weight", tied, 256, lambda j: j)
    assert rule.hf_names == ("model.embed_tokens.weight",)
    value = ModelArch(**{**ARCH.__dict__, "kind": "value"})
    assert mapping.rule_for("output_layer.weight", value, 256, lambda j: j).hf_names == (
        "score.weight",)


def test_unknown_parameter_is_refused():
    with pytest.raises(Exception, match="no HF mapping"):
        _rule("decoder.layers.0.mystery.weight")
