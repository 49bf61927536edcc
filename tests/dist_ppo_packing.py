"""PPO sequence packing parity, run under torchrun (2 ranks) by tests/test_ppo_packing.py.

For each layout of the 2-rank world, the same PPO batch (samples of very different lengths, a
short one between long ones) goes through the actor twice, padded and packed: old log-probs
(forward only) and one optimizer step of the PPO loss (metric sums and gradient norm) must agree.
Usage: torchrun --nproc-per-node 2 tests/dist_ppo_packing.py MODELS_ROOT OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rlhf.config.ppo_schema import ActorConfig  # noqa: E402
from megatron_rlhf.distributed.launch import init_distributed  # noqa: E402
from megatron_rlhf.models.forward import pipeline_forward  # noqa: E402
from megatron_rlhf.rollout.base import Generation  # noqa: E402
from megatron_rlhf.trainers.engine import make_trainable, reduce_metrics, train_step  # noqa: E402
from megatron_rlhf.trainers.rl.experience import build_batch  # noqa: E402
from megatron_rlhf.trainers.rl.losses import actor_loss, grid_logprobs  # noqa: E402
from megatron_rlhf.trainers.rl.worker import ACTOR_KEYS, micro_batches  # noqa: E402
from megatron_rlhf.data.packing import grid_tensor  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_parity import from_hf, max_over_world  # noqa: E402

LAYOUTS = {"dp2": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}
CAPACITY = 48  # every micro-batch of two samples fits in one row


def make_batch() -> dict:
    generator = torch.Generator().manual_seed(3)
    prompts = [tuple(torch.randint(3, 250, (n,), generator=generator).tolist()) for n in (9, 3, 11, 5)]
    responses = [7, 2, 12, 1, 9, 4, 3, 10]
    gens = [Generation(i % 4, torch.randint(3, 250, (n,), generator=generator).tolist(), [], True)
            for i, n in enumerate(responses)]
    batch = build_batch(prompts, gens, pad_id=0)
    shape = batch["loss_mask"].shape
    batch["old_logprobs"] = -torch.rand(shape, generator=generator) * 5 * batch["loss_mask"]
    batch["ref_logprobs"] = -torch.rand(shape, generator=generator) * 5 * batch["loss_mask"]
    batch["advantages"] = torch.randn(shape, generator=generator) * batch["loss_mask"]
    return batch


def head(groups, vocab):
    return lambda out, b: grid_logprobs(out, b, vocab, groups) * grid_tensor(b, "loss_mask")


def run(root: Path, layout, pack: int, agg: str) -> tuple:
    model, groups, arch = from_hf(root / "qwen2_policy", layout)
    batch = make_batch()
    rows = list(range(batch["input_ids"].shape[0]))
    mine = rows[groups.dp_rank::groups.layout.dp]
    micro = micro_batches(batch, mine, 2, pack_capacity=pack)
    logprobs = pipeline_forward(model, groups, micro, head(groups, arch.vocab_size))
    logprobs = [torch.nn.functional.pad(x, (0, batch["input_ids"].shape[1] - x.shape[1]))
                for x in logprobs]
    cfg = ActorConfig(model_path="-", entropy_coeff=0.01, use_kl_loss=True, loss_agg_mode=agg)
    trainable = make_trainable(model, groups, cfg.optim, 1)
    denominator = (float(batch["loss_mask"].sum()) if agg == "token-mean" else float(len(rows)))
    weight = 2 * groups.layout.dp / denominator  # two micro-batches per rank
    loss = lambda out, b: actor_loss(out, b, vocab_size=arch.vocab_size, groups=groups, cfg=cfg,  # noqa: E731
                                     kl_loss_coef=0.1, temperature=1.0, horizon=16)
    result = train_step(trainable, micro_batches(batch, mine, 2, {"loss_weight": weight}, pack), loss)
    metrics = reduce_metrics(result.metrics, groups, ACTOR_KEYS)
    rows_used = sum(m["input_ids"].shape[0] for m in micro)
    return (torch.cat(logprobs) if logprobs else None), metrics, result.grad_norm, rows_used


def main() -> None:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist = init_distributed()
    results = {}
    for label, layout in LAYOUTS.items():
        for agg in ("token-mean", "seq-mean-token-mean"):
            padded = run(root, layout, 0, agg)
            packed = run(root, layout, CAPACITY, agg)
            diff = None if padded[0] is None else float((padded[0] - packed[0]).abs().max())
            results[f"{label}/{agg}"] = {
                "logprob_diff": max_over_world(diff),
                "logprob_abs_max": max_over_world(None if padded[0] is None else float(padded[0].abs().max())),
                "metrics_padded": padded[1], "metrics_packed": packed[1],
                "grad_norm": [padded[2], packed[2]], "rows": [padded[3], packed[3]]}
    if dist.rank == 0:
        out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
