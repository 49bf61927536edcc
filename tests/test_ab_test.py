"""`megatron-rlhf ab-test` end to end on CPU: same seeds give the same samples on any number of
processes, a policy against itself ties, the files are written, and bad input is one line."""

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ab_workspace(tmp_path_factory):
    """The bundled task's tiny base policy, its held-out prompts, and a (random) reward model
    reading the same tokenizer."""
    from transformers import AutoTokenizer

    from megatron_rlhf.models.tiny import make_tiny_model, tiny_config
    from tests.tiny_models import build_task_workspace

    root = build_task_workspace(tmp_path_factory.mktemp("ab"), train=64, val=12, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(root / "base")
    vocab = json.loads((root / "base" / "config.json").read_text())["vocab_size"]
    make_tiny_model(tiny_config("qwen2", "value", vocab_size=vocab,
                                pad_token_id=tokenizer.pad_token_id), root / "rm", seed=1)
    tokenizer.save_pretrained(root / "rm")
    # The same policy as a megatron_rlhf checkpoint (what sft and ppo write).
    subprocess.run([sys.executable, "-m", "megatron_rlhf.cli", "convert", "hf-to-mcore",
                    "--hf-dir", str(root / "base"), "--out-dir", str(root / "base_ckpt")],
                   check=True, capture_output=True)
    return root


def ab_test(root, out, *extra):
    args = [sys.executable, "-m", "megatron_rlhf.cli", "ab-test", "--policy-a", str(root / "base"),
            "--policy-b", str(root / "base"), "--prompts",
            str(root / "data" / "prompts_val.parquet"), "--samples-per-prompt", "2",
            "--max-new-tokens", "8", "--temperature", "1.0", "--num-resamples", "200",
            "--out", str(out), *extra]
    return subprocess.run(args, capture_output=True, text=True, timeout=600)


def test_a_policy_against_itself_ties_and_the_files_are_written(ab_workspace, tmp_path):
    # A: the policy as a megatron_rlhf checkpoint; B: the same weights as an HF folder.
    out = tmp_path / "ab"
    proc = ab_test(ab_workspace, out, "--judge", f"rm:{ab_workspace / 'rm'},fn:addition",
                   "--policy-a", str(ab_workspace / "base_ckpt"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = pq.read_table(out / "pairs.parquet").to_pylist()
    assert len(rows) == 12 * 2
    summary = json.loads((out / "summary.json").read_text())
    # Same policy, same seeds: the same responses, so every pair ties under every judge.
    assert summary["tie"] == 1.0 and summary["win_rate"]["estimate"] == 0.5
    assert summary["win_rate"]["low"] == summary["win_rate"]["high"] == 0.5
    assert summary["sign_test"]["p_value"] == 1.0
    assert (out / "ab_test.png").stat().st_size > 0
    assert "win rate" in proc.stdout


def test_samples_do_not_depend_on_the_number_of_processes(ab_workspace, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    for out, extra in ((one, ()), (two, ("--nproc-per-node", "2"))):
        proc = ab_test(ab_workspace, out, "--judge", "fn:addition", "--batch-size", "8", *extra)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first, second = (pq.read_table(o / "pairs.parquet").to_pylist() for o in (one, two))
    assert first == second


@pytest.mark.parametrize("change, message", [
    (("--policy-a", "{rm}"), "--policy-a: {rm} is a reward-model (value) checkpoint, not a policy"),
    (("--judge", "fn:nope"), "--judge fn='nope' is not a built-in reward"),
    (("--judge", "rm:{base}"), "is a policy (causal LM), not a reward model"),
    (("--prompts", "{noprompt}"), "{noprompt}: missing column 'prompt' (has question)"),
])
def test_bad_input_is_one_line(ab_workspace, tmp_path, change, message):
    names = {"rm": ab_workspace / "rm", "base": ab_workspace / "base",
             "noprompt": tmp_path / "questions.parquet"}
    pq.write_table(pa.table({"question": ["What is 1 + 1?"]}), names["noprompt"])
    flag, value = change[0], change[1].format(**names)
    out = tmp_path / "ab"
    args = ["--judge", "fn:addition"] if flag != "--judge" else []
    proc = ab_test(ab_workspace, out, *args, flag, value)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert message.format(**names) in proc.stderr.strip().splitlines()[-1]
    assert not out.exists()


def test_a_non_empty_out_folder_is_refused(ab_workspace, tmp_path):
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "keep.txt").write_text("finished work")
    proc = ab_test(ab_workspace, tmp_path / "ab", "--judge", "fn:addition")
    assert proc.returncode == 2 and "already exists and is not empty" in proc.stderr
    assert (tmp_path / "ab" / "keep.txt").read_text() == "finished work"


def test_tensor_parallel_judging_matches_one_process(ab_workspace, tmp_path):
    """``--tp 2`` over two processes: the same responses, and the reward model (split over two
    ranks) scores them as one process does."""
    judge = ("--judge", f"rm:{ab_workspace / 'rm'}", "--policy-a", str(ab_workspace / "base_ckpt"),
             "--batch-size", "8")
    one, two = tmp_path / "one", tmp_path / "tp2"
    for out, extra in ((one, ()), (two, ("--nproc-per-node", "2", "--tp", "2"))):
        proc = ab_test(ab_workspace, out, *judge, *extra)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first, second = (pq.read_table(o / "pairs.parquet").to_pylist() for o in (one, two))
    assert len(first) == len(second) == 24
    for a, b in zip(first, second):
        assert a["response_a"] == b["response_a"] and a["response_b"] == b["response_b"]
        assert abs(a["score_a"] - b["score_a"]) < 1e-4 and abs(a["score_b"] - b["score_b"]) < 1e-4
