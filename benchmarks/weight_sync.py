"""Weight-sync time against its floor: one flat all-gather plus one copy of the same bytes.

    torchrun --nproc-per-node 2 benchmarks/weight_sync.py --hidden 512 --layers 8 --vocab 32000

A Qwen2-shaped Megatron actor is built at trainer TP=2 (and again at PP=2); the resharding sync
streams it into an HF rollout engine (TP=1) on every rank. The floor moves the same bytes the
cheapest possible way: each rank all-gathers its 1/world share of one flat buffer and copies the
result once into a second buffer (what any sync must at least do: gather, then write into the
engine). Reported: median of ``--repeats`` timed runs after one warm-up, sync and floor taking
turns. The engine adopts the contiguous tensors the sync hands it instead of copying them (see
``HFGenerator.load_weights``), so a sync can beat this floor.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rlhf.distributed.launch import init_distributed  # noqa: E402
from megatron_rlhf.distributed.layout import ParallelLayout, build_parallel_groups  # noqa: E402
from megatron_rlhf.models.builder import build_model  # noqa: E402
from megatron_rlhf.models.hf_config import arch_from_hf_config, padded_vocab_size  # noqa: E402
from megatron_rlhf.rollout.hf_engine import HFGenerator  # noqa: E402
from megatron_rlhf.rollout.weight_sync import WeightSync  # noqa: E402


def timed(fns: list, repeats: int) -> list[float]:
    """Median seconds of each of ``fns``, run in turns (one warm-up round) so that background
    load on a shared machine hits all of them alike."""
    times = [[] for _ in fns]
    for round_ in range(repeats + 1):
        for fn, samples in zip(fns, times):
            dist.barrier()
            start = time.perf_counter()
            fn()
            dist.barrier()
            if round_:
                samples.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def floor_fn(total_bytes: int, dtype: torch.dtype):
    world = dist.get_world_size()
    numel = total_bytes // dtype.itemsize // world * world
    local = torch.randn(numel // world).to(dtype)
    gathered = torch.empty(numel, dtype=dtype)
    target = torch.empty(numel, dtype=dtype)

    def run():
        dist.all_gather_into_tensor(gathered, local)
        target.copy_(gathered)

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from transformers import Qwen2Config

    init_distributed()
    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
                         architectures=["Qwen2ForCausalLM"])
    box = [tempfile.mkdtemp(prefix="bench_sync_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    if dist.get_rank() == 0:
        config.save_pretrained(box[0])
    dist.barrier()
    arch = arch_from_hf_config(config)
    engine = HFGenerator(box[0], torch.float32, pad_id=0, eos_id=1)
    rows = []
    for label, layout in (("TP=2 -> engine TP=1", ParallelLayout(tp=2)),
                          ("PP=2 -> engine TP=1", ParallelLayout(pp=2))):
        groups = build_parallel_groups(layout, arch.shape)
        padded = padded_vocab_size(arch.vocab_size, groups.layout.tp)
        model = build_model(arch, groups, torch.float32, padded)
        sync = WeightSync(model, arch, groups, padded, int(args.bucket_mb * 2 ** 20))
        seconds, floor = timed([lambda: sync.sync(engine.load_weights),
                                floor_fn(sync.total_bytes, torch.float32)], args.repeats)
        rows.append({"layout": label, "bytes": sync.total_bytes, "buckets": len(sync.buckets),
                     "sync_s": seconds, "floor_s": floor, "ratio": seconds / floor})
        del model, sync
    if dist.get_rank() == 0:
        print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; "
              f"bucket {args.bucket_mb} MiB; {dist.get_world_size()} ranks, "
              f"{torch.get_num_threads()} thread(s) each")
        print("| layout | MiB | buckets | sync s | floor s | sync / floor |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['layout']} | {r['bytes'] / 2**20:.0f} | {r['buckets']} | {r['sync_s']:.3f} | "
                  f"{r['floor_s']:.3f} | {r['ratio']:.2f}x |")
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=2))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
