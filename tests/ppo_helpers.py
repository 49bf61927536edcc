"""What the end-to-end PPO test files share: the tiny task's workspace, the command line of a
run, its launch and its metrics rows (tests/test_ppo*.py, tests/test_tool_turns.py)."""

import json
import subprocess
import sys
from pathlib import Path

VOLATILE = ("timing/", "throughput/", "busy/")


def build_workspace(tmp_path_factory) -> Path:
    from tests.tiny_models import build_task_workspace

    return build_task_workspace(tmp_path_factory.mktemp("ppo"), train=256, val=16, seed=0)


def overrides(ws: Path, out: Path, *extra: str) -> list[str]:
    data = ws / "data"
    return [f"actor.model_path={ws / 'base'}", f"data.train_files=[{data / 'prompts_train.parquet'}]",
            f"data.val_files=[{data / 'prompts_val.parquet'}]", "data.max_prompt_length=32",
            "data.max_response_length=8", "data.train_batch_size=16", "actor.ppo_mini_batch_size=8",
            "actor.ppo_micro_batch_size_per_rank=4", "actor.ppo_epochs=2", "actor.optim.lr=1e-3",
            "actor.optim.min_lr=1e-3", "reward.fn=addition", "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.05",
            "trainer.logger=tensorboard", f"trainer.output_dir={out}", "trainer.eval_every_steps=3",
            *extra]


def ppo(args: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megatron_rlhf.cli", "ppo", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)


def finish(proc: subprocess.Popen, timeout: int = 600) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in rows]


# Sampling at a temperature other than 1 checks that engine and actor score the same (tempered)
# distribution.
FULL_RUN = ("trainer.max_steps=6", "trainer.save_every_steps=2", "rollout.temperature=0.7",
            "actor.use_kl_loss=true", "actor.kl_loss_coef=0.02")


# Greedy rollouts, no validation: runs whose metrics other runs must equal exactly.
GREEDY = ("rollout.temperature=0", "trainer.eval_every_steps=0", "trainer.val_before_train=false")


def continued(prefix: Path, out: Path) -> Path:
    """A copy of a finished run's folder, to go on from its checkpoints."""
    import shutil

    shutil.copytree(prefix, out)
    return out


def checkpoint_tensors(step_dir: Path) -> dict:
    """Every tensor of a checkpoint's model folder, read without a process group."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(step_dir / "model"), f"{tmp}/all.pt")
        state = torch.load(f"{tmp}/all.pt", weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def teacher_forced(hf_dir: Path, rows: list[dict]):
    """log p(response token) of every dumped sample under the model in ``hf_dir`` (temperature 1)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            start = len(r["prompt_ids"]) - 1
            out.append(logp[start:start + len(r["response_ids"])]
                       .gather(-1, torch.tensor(r["response_ids"])[:, None])[:, 0])
    return torch.cat(out)
