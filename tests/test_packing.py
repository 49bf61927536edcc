"""Packing: block-diagonal causal masks equal a loop; packed model outputs equal unpacked ones."""

import torch

from megatron_rlhf.data.packing import pack_sequences, pad_batch


def test_first_fit_rows_and_last_index():
    packed = pack_sequences([[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]], row_capacity=6, pad_id=0)
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 5, 10], [6, 7, 8, 9, 0, 0]]
    assert packed.last_index.tolist() == [[0, 2], [0, 4], [1, 3], [0, 5]]
    assert packed.num_tokens == 10


def test_mask_matches_loop():
    seqs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    packed = pack_sequences(seqs, row_capacity=6, pad_id=0)
    mask = packed.attention_mask
    segments = [[0, 0, 0, 1, 1], [2, 2, 2, 2, -1]]
    assert mask.shape == (2, 1, 5, 5)
    for row in range(2):
        for i in range(5):
            for j in range(5):
                allowed = segments[row][i] >= 0 and segments[row][i] == segments[row][j] and j <= i
                allowed |= segments[row][i] < 0 and i == j  # padding sees only itself
                assert mask[row, 0, i, j].item() == (not allowed)


def test_padding_mode_is_one_sequence_per_row():
    packed = pack_sequences([[1, 2, 3], [4]], row_capacity=8, pad_id=7, remove_padding=False)
    assert packed.input_ids.tolist() == [[1, 2, 3], [4, 7, 7]] and packed.attention_mask is None


def test_pad_batch_masks_new_positions():
    packed = pack_sequences([[1, 2], [3]], row_capacity=4, pad_id=0)
    batch = pad_batch({"input_ids": packed.input_ids, "attention_mask": packed.attention_mask},
                      rows=2, length=5)
    assert batch["input_ids"].shape == (2, 5) and batch["real_shape"] == (1, 3)
    mask = batch["attention_mask"]
    eye = torch.eye(5, dtype=torch.bool)
    assert torch.equal(mask[1, 0], ~eye)  # a new row: every position sees only itself
    assert torch.equal(mask[0, 0, 3:], ~eye[3:])  # new columns of the old row likewise
    assert mask[0, 0, :3, 3:].all()  # real tokens never see padding
    assert torch.equal(mask[:1, :, :3, :3], packed.attention_mask)


def test_packed_attention_equals_separate_sequences():
    """RoPE attention with a block-diagonal mask: each packed sequence sees only itself."""
    from transformers import Qwen2Config, Qwen2Model

    torch.manual_seed(0)
    model = Qwen2Model(Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2)).eval()
    seqs = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    packed = pack_sequences(seqs, row_capacity=9, pad_id=0)
    additive = torch.zeros(packed.attention_mask.shape).masked_fill(packed.attention_mask, -1e9)
    with torch.no_grad():
        rows = model(packed.input_ids, attention_mask=additive).last_hidden_state
        for index, seq in enumerate(seqs):
            alone = model(torch.tensor([seq])).last_hidden_state[0, -1]
            row, pos = packed.last_index[index].tolist()
            assert torch.allclose(rows[row, pos], alone, atol=1e-5)
