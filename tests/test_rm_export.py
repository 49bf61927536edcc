"""An exported reward model is read by transformers where megatron-rlhf scores it: at the last
real token, also when the tokenizer pads with its EOS token and sequences end in EOS."""

from types import SimpleNamespace

import pytest
import torch

from megatron_rlhf.models.tiny import make_tiny_model, tiny_config, train_tokenizer
from megatron_rlhf.trainers.rl.value_init import reward_model_hf_config

TEXTS = ["what is 3 plus 4? the answer is 7.", "hello there", "what is 10 plus 2? 12"] * 20


def _lm_folder(tmp_path, spare_rows: int):
    """A tiny causal LM whose tokenizer has no pad token of its own (pad = EOS)."""
    tokenizer = train_tokenizer(TEXTS, tmp_path, vocab_size=300)
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(tmp_path)
    config = tiny_config("qwen2", "policy", vocab_size=len(tokenizer) + spare_rows,
                         pad_token_id=tokenizer.eos_token_id)
    make_tiny_model(config, tmp_path)
    return SimpleNamespace(hf_dir=tmp_path), tokenizer


def _batch_and_alone(config, pad: int, sequences: list[list[int]]):
    """transformers' scores of right-padded ``sequences`` in one batch, and each sequence's
    score at its last token."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    width = max(map(len, sequences))
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in sequences])
    mask = (ids != pad).long() if pad not in sum(sequences, []) else torch.tensor(
        [[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits[:, 0]
        # The head applied at each sequence's own last token, by hand.
        alone = torch.stack([model.score(model.model(torch.tensor([s])).last_hidden_state)[0, -1, 0]
                             for s in sequences])
    return batch, alone


def test_pad_equal_to_eos_gets_its_own_pad_token(tmp_path):
    source, tokenizer = _lm_folder(tmp_path, spare_rows=8)
    config, exported = reward_model_hf_config(source, tokenizer)
    eos = tokenizer.eos_token_id
    assert exported.pad_token_id not in (None, eos) and exported.pad_token_id < config.vocab_size
    assert config.pad_token_id == exported.pad_token_id
    assert tokenizer.pad_token_id == eos  # the training tokenizer is left as it was
    # Two replies ending in EOS, one shorter: the batch reads each at its EOS, as we score.
    sequences = [tokenizer("what is 3 plus 4? 7")["input_ids"] + [eos],
                 tokenizer("hello")["input_ids"] + [eos]]
    batch, alone = _batch_and_alone(config, exported.pad_token_id, sequences)
    assert torch.allclose(batch, alone, atol=1e-5)
    # What the export did before: pad = EOS makes transformers read one token early.
    config.pad_token_id = eos
    batch, alone = _batch_and_alone(config, eos, sequences)
    assert not torch.allclose(batch, alone, atol=1e-3)


def test_no_spare_row_keeps_eos_and_says_so(tmp_path, capsys):
    source, tokenizer = _lm_folder(tmp_path, spare_rows=0)
    config, exported = reward_model_hf_config(source, tokenizer)
    assert exported is tokenizer and config.pad_token_id == tokenizer.eos_token_id
    assert "one token early" in capsys.readouterr().out


@pytest.mark.parametrize("spare_rows", [0, 8])
def test_a_distinct_pad_token_is_kept(tmp_path, spare_rows):
    tokenizer = train_tokenizer(TEXTS, tmp_path, vocab_size=300)  # <|pad|> and <|end|> differ
    config = tiny_config("qwen2", "policy", vocab_size=len(tokenizer) + spare_rows,
                         pad_token_id=tokenizer.pad_token_id)
    make_tiny_model(config, tmp_path)
    exported_config, exported = reward_model_hf_config(SimpleNamespace(hf_dir=tmp_path), tokenizer)
    assert exported is tokenizer and exported_config.pad_token_id == tokenizer.pad_token_id
    assert exported_config.architectures == ["Qwen2ForSequenceClassification"]
