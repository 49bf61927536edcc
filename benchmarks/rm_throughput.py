"""Reward-model training throughput: `megatron-rlhf train-rm` vs TRL's RewardTrainer, side by side.

Same tiny Qwen2 architecture and initial weights, same preference pairs, same batch (pairs per
optimizer step and per micro-batch), same number of steps, same CPU threads. Each trainer runs in
its own process; the rate counts only the training steps (start-up and data loading excluded)
and tokens are real (non-padding) tokens of the pairs processed.

    python benchmarks/rm_throughput.py [--steps 60] [--batch 64] [--micro 32] [--threads 2]

Writes the table into docs/benchmarks.md. TRL is a benchmark-only dependency:
`pip install -c constraints-cpu.txt trl==1.16.0`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRL_RUN = r'''
import json, sys, time, torch
from datasets import Dataset
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
from trl import RewardConfig, RewardTrainer
import pyarrow.parquet as pq
base, data, steps, batch, micro, threads, out = sys.argv[1:8]
torch.set_num_threads(int(threads))
tok = AutoTokenizer.from_pretrained(base)
config = AutoConfig.from_pretrained(base)
config.architectures = ["Qwen2ForSequenceClassification"]; config.num_labels = 1
config.pad_token_id = tok.pad_token_id
model = AutoModelForSequenceClassification.from_pretrained(base, config=config)
rows = pq.read_table(data).to_pylist()
ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                         "chosen": [{"role": "assistant", "content": r["chosen"]}],
                         "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows])
args = RewardConfig(output_dir=out, max_steps=int(steps), per_device_train_batch_size=int(micro),
                    gradient_accumulation_steps=int(batch) // int(micro), learning_rate=1e-3,
                    lr_scheduler_type="cosine", warmup_ratio=0.05, logging_steps=10**9,
                    save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0,
                    max_length=64, seed=1, disable_tqdm=True, bf16=False)
trainer = RewardTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
tokens = [0]
class Count(TrainerCallback):
    pass
orig = trainer.compute_loss
def counted(model, inputs, *a, **k):
    tokens[0] += int(inputs["attention_mask"].sum())
    return orig(model, inputs, *a, **k)
trainer.compute_loss = counted
start = time.time()
trainer.train()
elapsed = time.time() - start
pairs = int(steps) * int(batch)
json.dump({"pairs_per_s": pairs / elapsed, "tokens_per_s": tokens[0] / elapsed, "seconds": elapsed},
          open(out + "/result.json", "w"))
'''


def prepare(root: Path) -> tuple[Path, Path]:
    import pyarrow.parquet as pq

    from megatron_rlhf.data.task_files import write_task_files
    from megatron_rlhf.models.tiny import make_tiny_base

    write_task_files(str(root / "data"), train=8000, val=64, seed=0, high=19)
    table = pq.read_table(root / "data" / "sft_train.parquet")
    texts = [p + " " + r for p, r in zip(table.column("prompt").to_pylist(),
                                         table.column("response").to_pylist())]
    make_tiny_base(root / "base", texts, hidden_size=128, num_layers=4)
    return root / "base", root / "data" / "prefs_train.parquet"


def run_ours(base, data, root, args) -> dict:
    out = root / "ours"
    command = [sys.executable, "-m", "megatron_rlhf.cli", "train-rm", "--config",
               str(ROOT / "configs/rm/tiny_cpu.yaml"), f"model.path={base}",
               f"data.train_files=[{data}]", "data.val_files=[]", f"trainer.output_dir={out}",
               f"trainer.max_steps={args.steps}", f"data.train_batch_size={args.batch}",
               f"data.micro_batch_size_per_rank={args.micro}", "trainer.logger=console",
               "trainer.save_every_steps=0", f"trainer.log_every_steps={args.steps}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    subprocess.run(command, check=True, env=env, cwd=ROOT, capture_output=True)
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    return {"pairs_per_s": last["throughput/pairs_per_s"],
            "tokens_per_s": last["throughput/tokens_per_s"]}


def run_trl(base, data, root, args) -> dict:
    out = root / "trl"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run([sys.executable, "-c", TRL_RUN, str(base), str(data), str(args.steps),
                    str(args.batch), str(args.micro), str(args.threads), str(out)],
                   check=True, env=env, capture_output=True)
    return json.loads((out / "result.json").read_text())


def write_report(ours: dict, trl: dict, args) -> str:
    ratio = ours["pairs_per_s"] / trl["pairs_per_s"]
    command = (f"python benchmarks/rm_throughput.py --steps {args.steps} --batch {args.batch} "
               f"--micro {args.micro} --threads {args.threads}")
    section = "\n".join([
        "## Reward-model training throughput vs TRL RewardTrainer (CPU)", "",
        f"Command: `{command}`", "",
        f"Tiny Qwen2 (4 layers, hidden 128), addition-task pairs, {args.batch} pairs/step in "
        f"micro-batches of {args.micro}, {args.steps} steps, {args.threads} CPU threads, fp32.", "",
        "| trainer | pairs/s | real tokens/s |", "|---|---|---|",
        f"| megatron-rlhf train-rm (packed) | {ours['pairs_per_s']:.1f} | {ours['tokens_per_s']:.0f} |",
        f"| TRL 1.16.0 RewardTrainer | {trl['pairs_per_s']:.1f} | {trl['tokens_per_s']:.0f} |",
        f"| ratio | {ratio:.2f}x | {ours['tokens_per_s'] / trl['tokens_per_s']:.2f}x |", ""])
    doc = ROOT / "docs" / "benchmarks.md"
    text = doc.read_text() if doc.is_file() else "# Benchmarks\n\nEvery number here was measured with the command shown.\n\n"
    start = text.find("## Reward-model training throughput")
    if start >= 0:
        end = text.find("\n## ", start + 1)
        text = text[:start] + text[end + 1 if end >= 0 else len(text):]
    doc.parent.mkdir(exist_ok=True)
    doc.write_text(text.rstrip() + "\n\n" + section)
    return section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=64, help="pairs per optimizer step")
    parser.add_argument("--micro", type=int, default=32, help="pairs per micro-batch")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base, data = prepare(root)
        ours = run_ours(base, data, root, args)
        trl = run_trl(base, data, root, args)
    print(write_report(ours, trl, args))


if __name__ == "__main__":
    main()
