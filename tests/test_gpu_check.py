"""tools/gpu_check.py, the script a lent GPU runs, kept runnable here: its tiny size on CPU must
pass every section with fp32 parity (a GPU run only shows whether the GPU path differs)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_every_section_at_its_tiny_size(tmp_path):
    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": "0"}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--model", "tiny",
                           "--seq", "64", "--micro", "2", "--micro-batches", "2", "--steps", "2",
                           "--new-tokens", "8", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["import"]["fp32"]["max_abs_diff"] < 1e-5
    assert result["import"]["bf16"]["max_abs_diff"] < 0.05  # bf16 weights and activations
    losses = result["train"]["losses"]
    assert len(losses) == 4 and losses[-1] < losses[0]  # the same rows every step
    # MFU's arithmetic (vs 989.4 dense bf16 TFLOPs): FLOPs per token from the config equal
    # 6 x (the model's own decoder matmul weights + the LM head) + 12 x layers x hidden x seq.
    train = result["train"]
    head = train["hidden"] * train["vocab"]
    attention = 12 * train["layers"] * train["hidden"] * train["seq"]
    assert train["model_flops_per_token"] == 6 * (train["layer_matmul_params"] + head) + attention
    expected = train["tokens_per_s"] * train["model_flops_per_token"] / 989.4e12
    assert abs(train["mfu_vs_989"] - expected) <= 1e-9 * expected
    planned = result["train"]["planned_gib"]  # the planner's terms of the same step
    assert planned["weights"] > 0 and planned["logits"] > 0 and planned["total"] > planned["weights"]
    # Each offload switch frees exactly what it holds (storages on CPU), what the planner
    # counts for that state (bf16 weights, fp32 gradients, fp32 main weights + Adam moments).
    offload = result["offload"]
    for name, term in (("params", "weights"), ("grads", "gradients"), ("optimizer", "optimizer")):
        assert offload[name]["freed_gib"] == offload[name]["resident_gib"] > 0
        assert abs(offload[name]["freed_gib"] / offload[name]["planned_gib"] - 1) < 0.02, name
    whole = offload["params+grads+optimizer"]
    assert whole["freed_gib"] == sum(offload[p]["freed_gib"] for p in ("params", "grads", "optimizer"))
    assert sorted(result["rollout"]) == ["hf_bf16", "hf_fp32"]  # no SGLang on CPU
    for dtype, bar in (("fp32", 1e-5), ("bf16", 0.05)):
        rollout = result["rollout"][f"hf_{dtype}"]
        assert 8 <= rollout["tokens"] <= 64  # 8 prompts x up to 8 greedy tokens (EOS ends one)
        assert rollout["max_abs_diff"] < bar and rollout["fixed_tokens"]["max_abs_diff"] < bar
