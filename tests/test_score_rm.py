"""`megatron-rlhf score-rm`: rewards equal transformers' at TP=1, TP=2 and PP=2, from the CLI."""

import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from megatron_rlhf.cli import main
from megatron_rlhf.data.chat import render_pair

ROWS = {
    "prompt": ["what is 3 plus 4?", "what is 10 plus 2?", "what is 1 plus 1?", "hello there",
               "what is 7 plus 0?"],
    "chosen": ["the answer is 7.", "the answer is 12.", "2", "hello", "7"],
    "rejected": ["the answer is 8.", "the answer is 11.", "3", "bye", "70"],
}


@pytest.fixture(scope="module")
def rm_setup(tiny_models, tmp_path_factory):
    work = tmp_path_factory.mktemp("score")
    data = work / "prefs.parquet"
    pq.write_table(pa.table(ROWS), data)
    mcore = work / "rm_mcore"
    assert main(["convert", "hf-to-mcore", "--hf-dir", str(tiny_models["qwen2_rm"]),
                 "--out-dir", str(mcore)]) == 0
    return work, data, mcore


def _hf_rewards(hf_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    assert tokenizer.chat_template  # the pair is rendered as a user and an assistant turn
    model = AutoModelForSequenceClassification.from_pretrained(hf_dir).eval()
    out = {}
    for column in ("chosen", "rejected"):
        with torch.no_grad():
            out[column] = [model(torch.tensor([render_pair(tokenizer, p, r)])).logits[0, 0].item()
                           for p, r in zip(ROWS["prompt"], ROWS[column])]
    return out


@pytest.mark.parametrize("layout", [[], ["--tp", "2", "--nproc-per-node", "2"],
                                    ["--pp", "2", "--nproc-per-node", "2"]],
                         ids=["tp1", "tp2", "pp2"])
def test_scores_match_transformers(rm_setup, tiny_models, layout):
    work, data, mcore = rm_setup
    out = work / f"scored_{'_'.join(layout) or 'tp1'}.parquet"
    command = [sys.executable, "-m", "megatron_rlhf.cli", "score-rm", "--model-dir", str(mcore),
               "--data", str(data), "--output", str(out), "--micro-batch-size", "3", *layout]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    table = pq.read_table(out)
    assert table.column_names == ["prompt", "chosen", "rejected", "chosen_reward", "rejected_reward"]
    expected = _hf_rewards(tiny_models["qwen2_rm"])
    for column in ("chosen", "rejected"):
        got = table.column(f"{column}_reward").to_pylist()
        assert max(abs(a - b) for a, b in zip(got, expected[column])) < 1e-5
    wins = sum(c > r for c, r in zip(expected["chosen"], expected["rejected"]))
    assert f"pairwise accuracy {wins / len(ROWS['prompt']):.4f}" in proc.stdout


@pytest.mark.parametrize("layout", [["--ep", "2"], ["--pp", "2"]], ids=["ep2", "pp2_uneven"])
def test_a_mixture_of_experts_reward_model_scores_like_transformers(tiny_models, tmp_path, layout):
    """The layout options the trainers have, on score-rm: a 3-layer MoE reward model imported
    at EP=2, scored at EP=2 and at PP=2 (stages of 1 and 2 layers), equals transformers."""
    data = tmp_path / "prefs.parquet"
    pq.write_table(pa.table(ROWS), data)
    mcore, out = tmp_path / "moe_rm", tmp_path / "scored.parquet"
    two = ["--nproc-per-node", "2"]
    for command in (["convert", "hf-to-mcore", "--hf-dir", str(tiny_models["qwen3_moe_rm"]),
                     "--out-dir", str(mcore), "--ep", "2", *two],
                    ["score-rm", "--model-dir", str(mcore), "--data", str(data), "--output",
                     str(out), *layout, *two]):
        proc = subprocess.run([sys.executable, "-m", "megatron_rlhf.cli", *command],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
    if "--pp" in layout:
        assert "3 layers over pp=2: stages of 1 / 2 layers" in proc.stdout
    expected = _hf_rewards(tiny_models["qwen3_moe_rm"])
    table = pq.read_table(out)
    for column in ("chosen", "rejected"):
        got = table.column(f"{column}_reward").to_pylist()
        assert max(abs(a - b) for a, b in zip(got, expected[column])) < 1e-5


def test_missing_column_is_reported(rm_setup, tmp_path, capsys):
    _, _, mcore = rm_setup
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "chosen": ["b"]}), bad)
    assert main(["score-rm", "--model-dir", str(mcore), "--data", str(bad),
                 "--output", str(tmp_path / "o.parquet")]) == 2
    assert capsys.readouterr().err.strip().endswith(
        f"error: {bad}: missing column 'rejected' (has prompt, chosen)")
    assert not (tmp_path / "o.parquet").exists()


def test_null_and_over_long_rows_are_reported(rm_setup, tmp_path, capsys):
    _, _, mcore = rm_setup
    bad = tmp_path / "null.parquet"
    pq.write_table(pa.table({"prompt": ["a", None], "chosen": ["b", "c"], "rejected": ["d", "e"]}), bad)
    assert main(["score-rm", "--model-dir", str(mcore), "--data", str(bad),
                 "--output", str(tmp_path / "o.parquet")]) == 2
    assert f"error: {bad}: column 'prompt' row 1 is null or empty" in capsys.readouterr().err
    long = tmp_path / "long.parquet"
    pq.write_table(pa.table({"prompt": ["x"], "chosen": ["word " * 400], "rejected": ["y"]}), long)
    assert main(["score-rm", "--model-dir", str(mcore), "--data", str(long),
                 "--output", str(tmp_path / "o.parquet")]) == 2
    assert "row 0 prompt+chosen is" in capsys.readouterr().err


def test_message_list_rows_score_like_strings(rm_setup, tmp_path):
    _, data, mcore = rm_setup
    rows = pq.read_table(data).to_pylist()
    as_messages = [{"prompt": [{"role": "user", "content": r["prompt"]}],
                    "chosen": [{"role": "assistant", "content": r["chosen"]}],
                    "rejected": [{"role": "user", "content": r["prompt"]},
                                 {"role": "assistant", "content": r["rejected"]}]} for r in rows]
    messages = tmp_path / "messages.parquet"
    pq.write_table(pa.Table.from_pylist(as_messages), messages)
    for source, out in ((data, tmp_path / "a.parquet"), (messages, tmp_path / "b.parquet")):
        assert main(["score-rm", "--model-dir", str(mcore), "--data", str(source),
                     "--output", str(out)]) == 0
    a, b = pq.read_table(tmp_path / "a.parquet"), pq.read_table(tmp_path / "b.parquet")
    for column in ("chosen_reward", "rejected_reward"):
        # Same tokens, two model loads: equal up to kernel rounding (another memory alignment
        # may round differently); a different rendering would move them by far more.
        assert a.column(column).to_pylist() == pytest.approx(b.column(column).to_pylist(), abs=1e-5)
