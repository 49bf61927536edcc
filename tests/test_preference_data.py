"""Preference Parquet: chat rendering, message lists, length policy, and clear errors."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rlhf.data.preference import load_pairs
from megatron_rlhf.errors import UserError
from megatron_rlhf.models.tiny import train_tokenizer
from megatron_rlhf.data.public_formats import convert_rows, parse_hh_transcript


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    texts = [f"What is {a} + {b}? The answer is {a + b}." for a in range(30) for b in range(30)]
    return train_tokenizer(texts, tmp_path_factory.mktemp("tok"), vocab_size=300)


def _write(path, **columns):
    pq.write_table(pa.table(columns), path)
    return str(path)


def test_string_and_message_rows_render_alike(tokenizer, tmp_path):
    plain = _write(tmp_path / "a.parquet", prompt=["What is 1 + 2?"], chosen=["The answer is 3."],
                   rejected=["The answer is 4."])
    messages = _write(tmp_path / "b.parquet",
                      prompt=[[{"role": "user", "content": "What is 1 + 2?"}]],
                      chosen=[[{"role": "user", "content": "What is 1 + 2?"},
                               {"role": "assistant", "content": "The answer is 3."}]],
                      rejected=[[{"role": "assistant", "content": "The answer is 4."}]])
    (a,), _ = load_pairs([plain], tokenizer, 64, 64, "truncate")
    (b,), _ = load_pairs([messages], tokenizer, 64, 64, "truncate")
    assert a == b
    text = tokenizer.decode(list(a.chosen))
    assert text == "<|user|>What is 1 + 2?<|end|><|assistant|>The answer is 3.<|end|>"


def test_length_policy_truncate_and_drop(tokenizer, tmp_path):
    path = _write(tmp_path / "long.parquet", prompt=["What is 1 + 2?", "What is 10 + 20?"],
                  chosen=["The answer is 3.", "The answer is 30. " * 10],
                  rejected=["The answer is 4.", "The answer is 31."])
    pairs, report = load_pairs([path], tokenizer, 64, 12, "truncate")
    assert (report.total, report.truncated, report.dropped) == (2, 1, 0)
    from megatron_rlhf.data.preference import split_prompt_response

    head, _ = split_prompt_response(tokenizer, [{"role": "user", "content": "What is 10 + 20?"}],
                                    [{"role": "assistant", "content": "x"}])
    assert len(pairs[1].chosen) == len(head) + 12  # the response keeps its first 12 tokens
    pairs, report = load_pairs([path], tokenizer, 64, 12, "drop")
    assert (len(pairs), report.dropped) == (1, 1)
    assert "1 dropped as over-long" in str(report)


@pytest.mark.parametrize("columns, message", [
    ({"prompt": ["a"], "chosen": ["b"]}, "missing column 'rejected' (has prompt, chosen)"),
    ({"prompt": ["a", None], "chosen": ["b", "c"], "rejected": ["d", "e"]},
     "column 'prompt' row 1 is null or empty"),
    ({"prompt": ["a", "b"], "chosen": ["b", ""], "rejected": ["d", "e"]},
     "column 'chosen' row 1 is null or empty"),
    ({"prompt": [1, 2], "chosen": ["b", "c"], "rejected": ["d", "e"]},
     "column 'prompt' row 0 has type int, expected a string or a list of messages"),
    ({"prompt": [[{"role": "user"}]], "chosen": ["b"], "rejected": ["c"]},
     "column 'prompt' row 0: expected a string or a list of {role, content} messages"),
])
def test_bad_rows_are_named(tokenizer, tmp_path, columns, message):
    path = _write(tmp_path / "bad.parquet", **columns)
    with pytest.raises(UserError) as err:
        load_pairs([path], tokenizer, 64, 64, "truncate")
    assert str(err.value) == f"{path}: {message}"


def test_unreadable_file(tokenizer, tmp_path):
    path = tmp_path / "junk.parquet"
    path.write_bytes(b"definitely not parquet")
    with pytest.raises(UserError, match=f"{path}: not a readable Parquet file"):
        load_pairs([str(path)], tokenizer, 64, 64, "truncate")
    with pytest.raises(UserError, match="file not found"):
        load_pairs([str(tmp_path / "absent.parquet")], tokenizer, 64, 64, "truncate")
    with pytest.raises(UserError, match=f"{tmp_path}: is a folder"):
        load_pairs([str(tmp_path)], tokenizer, 64, 64, "truncate")


def test_hh_rlhf_conversion():
    chosen = "\n\nHuman: hi\n\nAssistant: hello!\n\nHuman: 2+2?\n\nAssistant: 4"
    rejected = "\n\nHuman: hi\n\nAssistant: hello!\n\nHuman: 2+2?\n\nAssistant: 5"
    assert parse_hh_transcript(chosen)[2] == {"role": "user", "content": "2+2?"}
    rows, skipped = convert_rows([{"chosen": chosen, "rejected": rejected},
                                  {"chosen": chosen, "rejected": "\n\nHuman: other\n\nAssistant: 5"},
                                  {"chosen": "no markers", "rejected": rejected}], "hh-rlhf")
    assert rows == [{"prompt": [{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "hello!"},
                                {"role": "user", "content": "2+2?"}],
                     "chosen": "4", "rejected": "5"}]
    assert [index for index, _ in skipped] == [1, 2]


def test_ultrafeedback_conversion_with_margin(tokenizer, tmp_path):
    user = {"role": "user", "content": "What is 2 + 2?"}
    rows, skipped = convert_rows([{
        "prompt": "What is 2 + 2?", "score_chosen": 9.0, "score_rejected": 4.5,
        "chosen": [user, {"role": "assistant", "content": "The answer is 4."}],
        "rejected": [user, {"role": "assistant", "content": "The answer is 5."}]}], "ultrafeedback")
    assert not skipped and rows[0]["margin"] == 4.5 and rows[0]["chosen"] == "The answer is 4."
    path = tmp_path / "uf.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    pairs, _ = load_pairs([str(path)], tokenizer, 64, 64, "truncate", margin_column="margin")
    assert pairs[0].margin == 4.5


def test_margin_must_be_a_number(tokenizer, tmp_path):
    path = _write(tmp_path / "m.parquet", prompt=["a", "b"], chosen=["c", "d"], rejected=["e", "f"],
                  margin=[1.0, None])
    with pytest.raises(UserError, match=r"column 'margin' row 1: expected a finite number, got None"):
        load_pairs([path], tokenizer, 64, 64, "truncate", margin_column="margin")
    path = _write(tmp_path / "nan.parquet", prompt=["a"], chosen=["c"], rejected=["e"],
                  margin=[float("nan")])
    with pytest.raises(UserError, match=r"nan.parquet: column 'margin' row 0: expected a finite number"):
        load_pairs([path], tokenizer, 64, 64, "truncate", margin_column="margin")


def test_pairs_without_a_preference_are_dropped_and_counted(tokenizer, tmp_path):
    # Row 1 is the same answer twice; row 2's answers differ only past the 12-token limit.
    path = _write(tmp_path / "same.parquet", prompt=["What is 1 + 2?"] * 3,
                  chosen=["The answer is 3.", "The answer is 3.", "The answer is 3. " * 5 + "Yes"],
                  rejected=["The answer is 4.", "The answer is 3.", "The answer is 3. " * 5 + "No"])
    pairs, report = load_pairs([path], tokenizer, 64, 12, "truncate")
    assert (len(pairs), report.total, report.identical) == (1, 3, 2)
    assert "2 dropped as identical" in str(report)


def test_converter_keeps_margins_when_the_first_row_has_none(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    user = {"role": "user", "content": "q"}
    rows = [{"chosen": [user, {"role": "assistant", "content": "a"}],
             "rejected": [user, {"role": "assistant", "content": "b"}]},
            {"chosen": [user, {"role": "assistant", "content": "c"}],
             "rejected": [user, {"role": "assistant", "content": "d"}],
             "score_chosen": 5.0, "score_rejected": 1.0}]
    source = tmp_path / "uf.json"
    source.write_text(json.dumps(rows))
    script = Path(__file__).resolve().parents[1] / "tools" / "convert_preference_data.py"
    subprocess.run([sys.executable, str(script), "--layout", "ultrafeedback", "--input", str(source),
                    "--output", str(tmp_path / "out.parquet")], check=True, capture_output=True)
    assert pq.read_table(tmp_path / "out.parquet").column("margin").to_pylist() == [None, 4.0]


def test_a_converted_pair_needs_a_user_turn():
    """The loader refuses prompts without a user message, so the converter skips such rows
    instead of writing a file the trainer would reject."""
    odd = "\n\nAssistant: hello!\n\nAssistant: "
    rows, skipped = convert_rows([{"chosen": odd + "4", "rejected": odd + "5"}], "hh-rlhf")
    assert rows == [] and skipped == [(0, "no user turn before the final reply")]
