"""One PPO actor update over heavy-tailed sample lengths: padded micro-batches, packed ones of a
fixed sample count, and micro-batches packed to a token budget (``actor.ppo_micro_batch_tokens_per_rank``).

    python benchmarks/update_packing.py [--samples 64] [--micro 8] [--budget 2048] [--reps 3]
        [--threads 2] [--out result.json]

One process (a gloo world of one), a random Qwen2 of hidden 256, 4 layers, 8192-token vocabulary,
fp32. Prompt lengths uniform in 16..64, response lengths lognormal (median 40 tokens, capped at
512): most samples are short, a few are long, as in RL on reasoning tasks. Every mode runs the
same samples through ``train_step`` with the PPO loss (lean log-probs); packed rows hold up to the
longest sample's length (``max_prompt + max_response`` in a run); the time is the median
of ``--reps`` updates after one warm-up. ``computed tokens`` counts the positions the model runs
(padding included); ``real tokens`` the samples' own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def heavy_tailed_batch(samples: int, seed: int = 0):
    import torch

    from megatron_rlhf.rollout.base import Generation
    from megatron_rlhf.trainers.rl.experience import build_batch

    generator = torch.Generator().manual_seed(seed)
    prompts = [tuple(torch.randint(3, 8000, (int(n),), generator=generator).tolist())
               for n in torch.randint(16, 65, (samples,), generator=generator)]
    lengths = torch.exp(torch.randn(samples, generator=generator) * 1.0 + 3.7).clamp(1, 512).long()
    gens = [Generation(i, torch.randint(3, 8000, (int(n),), generator=generator).tolist(), [], True)
            for i, n in enumerate(lengths)]
    batch = build_batch(prompts, gens, pad_id=0)
    shape = batch["loss_mask"].shape
    batch["advantages"] = torch.randn(shape, generator=generator) * batch["loss_mask"]
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--micro", type=int, default=8, help="samples per micro-batch (fixed modes)")
    parser.add_argument("--budget", type=int, default=2048, help="tokens per micro-batch (budget mode)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    import torch

    from megatron_rlhf.distributed.launch import init_distributed

    torch.set_num_threads(args.threads)
    init_distributed()
    rows = run_modes(args)
    print(f"{args.samples} samples, lengths {rows['lengths']}, {args.threads} threads\n")
    print("| mode | micro-batches | computed tokens | real tokens | s/update | samples/s |")
    print("|---|---|---|---|---|---|")
    for name, r in rows["modes"].items():
        print(f"| {name} | {r['micro_batches']} | {r['computed_tokens']} | {r['real_tokens']} | "
              f"{r['seconds']:.2f} | {args.samples / r['seconds']:.1f} |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


def run_modes(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_rlhf.config.ppo_schema import ActorConfig
    from megatron_rlhf.models.tiny import tiny_config
    from megatron_rlhf.trainers.engine import make_trainable, train_step
    from megatron_rlhf.trainers.rl.losses import actor_loss
    from megatron_rlhf.models.output_head import output_head
    from megatron_rlhf.trainers.rl.micro_batches import micro_batches, token_groups

    sys.path.insert(0, str(ROOT / "tests"))
    from dist_parity import from_hf

    folder = Path(tempfile.mkdtemp()) / "policy"
    torch.manual_seed(0)
    config = tiny_config("qwen2", vocab_size=8192, hidden_size=256, num_layers=4)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    batch = heavy_tailed_batch(args.samples)
    lengths = batch["lengths"].reshape(-1)
    rows = list(range(args.samples))
    capacity = int(lengths.max())
    modes = {
        f"padded, {args.micro} samples": lambda: micro_batches(batch, rows, args.micro),
        f"packed, {args.micro} samples": lambda: micro_batches(batch, rows, args.micro, None, capacity),
        f"packed to {args.budget} tokens": lambda: [
            micro_batches(batch, g, len(g), None, capacity)[0]
            for g in token_groups(batch["lengths"], rows, args.budget)]}
    out = {"lengths": {"max": capacity, "median": int(lengths.median()), "mean": float(lengths.float().mean())},
           "modes": {}}
    for name, make in modes.items():
        model, groups, arch = from_hf(folder, (1, 1))
        cfg = ActorConfig(model_path="-")
        trainable = make_trainable(model, groups, cfg.optim, 10)
        head = output_head(trainable.model, arch.vocab_size, groups.tp, groups.tp_rank, 1024)
        loss = lambda o, b: actor_loss(o, b, vocab_size=arch.vocab_size, groups=groups, cfg=cfg,  # noqa: E731
                                       kl_loss_coef=0.0, temperature=1.0, horizon=512, head=head)
        micro = make()
        denominator = float(batch["loss_mask"].sum())
        for m in micro:
            m["loss_weight"] = len(micro) / denominator
        times = []
        for _ in range(args.reps + 1):
            start = time.perf_counter()
            train_step(trainable, micro, loss, hidden_states=True)
            times.append(time.perf_counter() - start)
        out["modes"][name] = {"micro_batches": len(micro),
                              "computed_tokens": sum(m["input_ids"].numel() for m in micro),
                              "real_tokens": int(lengths.sum()),
                              "seconds": statistics.median(times[1:])}
    return out


if __name__ == "__main__":
    main()
