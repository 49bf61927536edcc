"""GRPO on a reasoning-gym task with a tiny model, end to end on CPU: does the task's reward
lower the fraction of malformed answers (no ``<answer>`` tags) and raise accuracy?

    python benchmarks/task_grpo.py --work /tmp/task_grpo [--task chain_sum] [--sft-steps 40]

Writes the task's data (``tools/make_task_data.py --source reasoning-gym``, one-digit sums of two
numbers), a tiny model with a tokenizer trained on it, a short SFT warm start (a policy that has
half learnt the answer format), then runs ``configs/ppo/grpo_reasoning_gym_tiny_cpu.yaml`` and
prints the malformed fraction (1 - ``reward/answer_tagged``) and the reward per logged step.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASK_CONFIG = {"min_digits": 1, "max_digits": 1, "min_terms": 2, "max_terms": 2}


def _run(args: list[str], log: Path) -> None:
    with log.open("w") as handle:
        code = subprocess.call(args, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT)
    if code:
        sys.exit(f"{' '.join(args[:4])} failed; see {log}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True)
    parser.add_argument("--task", default="chain_sum")
    parser.add_argument("--n", type=int, default=160,
                        help="training questions (one-digit sums of two terms: about 190 distinct)")
    parser.add_argument("--sft-epochs", type=int, default=30)
    parser.add_argument("--sft-steps", type=int, default=0, help="stop SFT early (0: all epochs)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="extra key=value for the GRPO run")
    args = parser.parse_args()
    work = Path(args.work)
    data, base, sft, grpo = work / "data", work / "base", work / "sft", work / "grpo"
    work.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "megatron_rlhf.cli"]
    if not (data / "prompts_train.parquet").is_file():
        _run([sys.executable, "tools/make_task_data.py", "--source", "reasoning-gym", "--task",
              args.task, "--n", str(args.n), "--val", "20", "--seed", "0", "--task-config",
              json.dumps(TASK_CONFIG), "--out-dir", str(data)], work / "data.log")
    if not (base / "config.json").is_file():
        _run(cli + ["make-tiny-model", "--data-dir", str(data), "--out-dir", str(base),
                    "--hidden-size", "64"], work / "base.log")
    if not (sft / "final_metrics.json").is_file():
        _run(cli + ["sft", "--config", "configs/sft/tiny_cpu.yaml", f"model.path={base}",
                    f"data.train_files=[{data / 'sft_train.parquet'}]",
                    f"data.val_files=[{data / 'sft_val.parquet'}]", "data.max_prompt_length=48",
                    f"trainer.total_epochs={args.sft_epochs}", f"trainer.max_steps={args.sft_steps}",
                    f"trainer.output_dir={sft}",
                    f"trainer.seed={args.seed}"], work / "sft.log")
    start = sorted((sft / "checkpoints").glob("step_*"))[-1]  # max_steps, or 3 epochs if fewer
    _run(cli + ["ppo", "--config", "configs/ppo/grpo_reasoning_gym_tiny_cpu.yaml",
                f"actor.model_path={start}",
                f"data.train_files=[{data / 'prompts_train.parquet'}]",
                f"data.val_files=[{data / 'prompts_val.parquet'}]",
                f"reward.fn=reasoning_gym:{args.task}", f"trainer.output_dir={grpo}",
                "trainer.resume=disable", f"trainer.seed={args.seed}",
                "trainer.total_epochs=10", *args.overrides],
         work / "grpo.log")
    rows = [json.loads(line) for line in (grpo / "metrics.jsonl").read_text().splitlines()]
    print("| step | malformed fraction | reward (accuracy) | held-out accuracy (greedy) |")
    print("|---|---|---|---|")
    for row in rows:
        tagged, score = row.get("reward/answer_tagged"), row.get("reward/score_mean")
        val = row.get("val/oracle_acc")
        if tagged is None and val is None:
            continue
        cells = ["-" if v is None else f"{v:.3f}" for v in
                 (None if tagged is None else 1 - tagged, score, val)]
        print(f"| {row['step']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
