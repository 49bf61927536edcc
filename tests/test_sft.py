"""`megatron-rlhf sft`: response-only loss, layout parity, and agreement with transformers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from megatron_rlhf.cli import main
from megatron_rlhf.data.sft import SFTSample, sft_batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_labels_and_loss_mask_by_hand():
    samples = [SFTSample((1, 2, 3, 4), prompt_tokens=2), SFTSample((5, 6, 7), prompt_tokens=1)]
    batch = sft_batch(samples, capacity=8, pad_id=0, remove_padding=True, loss_scale=1.0)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7]]
    # position p predicts p+1; sample 1's response (3, 4) is predicted from positions 1 and 2,
    # sample 2's (6, 7) from positions 4 and 5; nothing crosses from one sample into the next.
    assert batch["targets"].tolist() == [[2, 3, 4, 0, 6, 7, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0, 1, 1, 0]]
    # An empty prompt part: the first token has no predictor, and the previous sample's last
    # position (whose target is 0) stays out of the loss.
    batch = sft_batch([SFTSample((1, 2), 2), SFTSample((5, 6, 7), 0)], capacity=8, pad_id=0,
                      remove_padding=True, loss_scale=1.0)
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 0]]


def test_without_a_chat_template_replies_start_on_a_new_line_and_end_with_eos(tmp_path):
    from megatron_rlhf.data.chat import render_prompt, split_prompt_response
    from megatron_rlhf.models.tiny import train_tokenizer
    from tests.tiny_models import TEXTS

    tokenizer = train_tokenizer(TEXTS, tmp_path, vocab_size=301, chat_template=False)
    prompt = [{"role": "user", "content": "what is 3 plus 4?"}]
    head, tail = split_prompt_response(tokenizer, prompt,
                                       [{"role": "assistant", "content": "the answer is 7."}])
    assert head == render_prompt(tokenizer, prompt)  # what PPO feeds the policy
    assert tokenizer.decode(head) == "what is 3 plus 4?\n"
    assert tail[-1] == tokenizer.eos_token_id  # the policy learns to stop
    assert tokenizer.decode(tail[:-1]) == "the answer is 7."


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from tests.tiny_models import build_task_workspace

    return build_task_workspace(tmp_path_factory.mktemp("sft"), train=256, val=32, seed=5)


def run_sft(workspace, out, nproc=1, *extra):
    command = [sys.executable, "-m", "megatron_rlhf.cli", "sft", "--config",
               "configs/sft/tiny_cpu.yaml", f"model.path={workspace / 'base'}",
               f"data.train_files=[{workspace / 'data' / 'sft_train.parquet'}]",
               f"data.val_files=[{workspace / 'data' / 'sft_val.parquet'}]",
               f"trainer.output_dir={out}", "data.train_batch_size=16",
               "data.micro_batch_size_per_rank=4", "trainer.max_steps=10", "trainer.logger=console",
               "trainer.log_every_steps=5", "trainer.save_every_steps=0", *extra]
    if nproc > 1:
        command += ["--nproc-per-node", str(nproc)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["train/loss"] for line in lines]


@pytest.fixture(scope="module")
def reference(workspace):
    return run_sft(workspace, workspace / "tp1")


LAYOUTS = {
    "tp2": ("parallel.tp=2",), "pp2": ("parallel.pp=2",), "dp2": (),
    # Memory features change where tensors live or when they are computed, never the numbers.
    "tp2_sequence_parallel": ("parallel.tp=2", "parallel.sequence_parallel=true"),
    "dp2_distributed_optimizer": ("parallel.use_distributed_optimizer=true",),
    "dp2_recompute_full": ("parallel.recompute_granularity=full",),
    "pp2_recompute_full_block": ("parallel.pp=2", "parallel.recompute_granularity=full",
                                 "parallel.recompute_method=block", "parallel.recompute_num_layers=1"),
    "tp2_recompute_selective": ("parallel.tp=2", "parallel.recompute_granularity=selective",
                                "parallel.recompute_modules=[core_attn,mlp,layernorm]"),
}


def final_weights(run: Path, tmp_path: Path) -> dict:
    from safetensors.torch import load_file

    hf = tmp_path / f"export_{run.name}"
    assert main(["convert", "mcore-to-hf", "--mcore-dir", str(run / "checkpoints" / "step_00000010"),
                 "--out-dir", str(hf)]) == 0
    return load_file(hf / "model.safetensors")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_reproduce_tp1_losses(workspace, reference, layout, tmp_path):
    got = run_sft(workspace, workspace / layout, 2, *LAYOUTS[layout])
    gap = max(abs(a - b) for a, b in zip(got, reference))
    print(f"sft {layout}: max |loss - loss(tp1)| over 10 steps = {gap:.2e}")
    assert len(got) == 10 and gap < 1e-4
    assert reference[-1] < reference[0]
    # The parameters after 10 Adam steps at lr 1e-3 too. A layout changes summation order
    # (~1e-7 in a gradient); Adam divides by sqrt(v) + eps, so a gradient near zero can move its
    # weight by up to ~lr in either direction: 5e-4 is half a step, far below a wrong update.
    want, have = final_weights(workspace / "tp1", tmp_path), final_weights(workspace / layout, tmp_path)
    worst = max((want[k] - have[k]).abs().max().item() for k in want)
    print(f"sft {layout}: max |param - param(tp1)| after 10 steps = {worst:.2e}")
    assert want.keys() == have.keys() and worst < 5e-4


def test_exported_policy_has_the_same_response_loss_in_transformers(workspace, reference, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rlhf.data.sft import load_samples

    checkpoint = workspace / "tp1" / "checkpoints" / "step_00000010"
    hf = tmp_path / "hf"
    assert main(["convert", "mcore-to-hf", "--mcore-dir", str(checkpoint), "--out-dir", str(hf)]) == 0
    model = AutoModelForCausalLM.from_pretrained(hf).eval()
    tokenizer = AutoTokenizer.from_pretrained(hf)
    samples, _ = load_samples([str(workspace / "data" / "sft_val.parquet")], tokenizer, 24, 16, "drop")
    total, count = 0.0, 0
    with torch.no_grad():
        for sample in samples:
            ids = torch.tensor([sample.ids])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            targets = ids[0, 1:]
            token_loss = -logp[torch.arange(len(targets)), targets]
            total += token_loss[sample.prompt_tokens - 1:].sum().item()
            count += sample.target_tokens
    final = json.loads((workspace / "tp1" / "final_metrics.json").read_text())
    assert abs(total / count - final["val/loss"]) < 1e-4
