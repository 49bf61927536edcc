"""PPO sequence packing parity, run under torchrun (2 ranks) by tests/test_ppo_packing.py.

For each layout of the 2-rank world, the same PPO batch (samples of very different lengths, a
short one between long ones) goes through the actor twice, padded and packed: old log-probs
(forward only) and one optimizer step of the PPO loss (metric sums and gradient norm) must agree.
Then the lean path (log-probs and entropy from hidden states at loss positions, in chunks of the
output layer) against full logits: log-probs, metric sums and every parameter's gradient, padded
and packed, for an untied (Qwen2) and a tied (Llama) policy, TP=2 with sequence parallelism too.
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
from megatron_rlhf.trainers.rl.micro_batches import micro_batches, token_groups  # noqa: E402
from megatron_rlhf.trainers.rl.worker import ACTOR_KEYS  # noqa: E402
from megatron_rlhf.data.packing import grid_tensor  # noqa: E402
from megatron_rlhf.models.megatron_config import ModelOptions  # noqa: E402
from megatron_rlhf.models.output_head import output_head  # noqa: E402
from megatron_rlhf.trainers.rl.losses import loss_positions_logprobs  # noqa: E402

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


def run(root: Path, layout, pack: int, agg: str, chunk: int = 0, name: str = "qwen2_policy",
        sequence_parallel: bool = False, budget: int = 0) -> tuple:
    """(log-probs, metric sums, grad norm, rows, gradients); ``chunk`` > 0: the lean path;
    ``budget`` > 0: micro-batches packed to that many tokens (the log-probs then in that order)."""
    options = ModelOptions(sequence_parallel=sequence_parallel)
    model, groups, arch = from_hf(root / name, layout, options=options)
    batch = make_batch()
    rows = list(range(batch["input_ids"].shape[0]))
    mine = rows[groups.dp_rank::groups.layout.dp]

    def make(extra=None):
        if not budget:
            return micro_batches(batch, mine, 2, extra, pack)
        return [micro_batches(batch, g, len(g), extra, CAPACITY)[0]
                for g in token_groups(batch["lengths"], mine, budget)]

    micro = make()
    out_head = (output_head(model, arch.vocab_size, groups.tp, groups.tp_rank, chunk)
                if chunk else None)
    score = (head(groups, arch.vocab_size) if out_head is None
             else lambda out, b: loss_positions_logprobs(out, b, out_head)[0])
    logprobs = pipeline_forward(model, groups, micro, score, hidden_states=bool(chunk))
    logprobs = [torch.nn.functional.pad(x, (0, batch["input_ids"].shape[1] - x.shape[1]))
                for x in logprobs]
    cfg = ActorConfig(model_path="-", entropy_coeff=0.01, use_kl_loss=True, loss_agg_mode=agg)
    trainable = make_trainable(model, groups, cfg.optim, 1)
    denominator = (float(batch["loss_mask"].sum()) if agg == "token-mean" else float(len(rows)))
    weight = len(micro) * groups.layout.dp / denominator
    if out_head is not None:  # DDP wrapped the model: its head's weight is the same parameter
        out_head = output_head(trainable.model, arch.vocab_size, groups.tp, groups.tp_rank, chunk)
    loss = lambda out, b: actor_loss(out, b, vocab_size=arch.vocab_size, groups=groups, cfg=cfg,  # noqa: E731
                                     kl_loss_coef=0.1, temperature=1.0, horizon=16, head=out_head)
    result = train_step(trainable, make({"loss_weight": weight}), loss, hidden_states=bool(chunk))
    metrics = reduce_metrics(result.metrics, groups, ACTOR_KEYS)
    rows_used = sum(m["input_ids"].shape[0] for m in micro)
    grads = torch.cat([p.main_grad.flatten() for p in trainable.model.parameters()])
    return (torch.cat(logprobs) if logprobs else None), metrics, result.grad_norm, rows_used, grads


LEAN = {"dp2": ((1, 1), "qwen2_policy", False), "tp2": ((2, 1), "qwen2_policy", False),
        "tp2_sp": ((2, 1), "qwen2_policy", True), "pp2": ((1, 2), "qwen2_policy", False),
        "tied_tp2": ((2, 1), "llama_policy", False), "tied_pp2": ((1, 2), "llama_policy", False)}


def budget_parity(root: Path, results: dict) -> None:
    """Micro-batches packed to 40 tokens (two or three a rank, of 1 to 4 samples) against
    padded micro-batches of two samples: the same update."""
    for label, layout in LAYOUTS.items():
        padded = run(root, layout, 0, "token-mean")
        packed = run(root, layout, 0, "token-mean", budget=40)
        results[f"budget/{label}"] = {
            "grad_diff": max_over_world(float((padded[4] - packed[4]).abs().max())),
            "grad_abs_max": max_over_world(float(padded[4].abs().max())),
            "metrics_padded": padded[1], "metrics_packed": packed[1],
            "grad_norm": [padded[2], packed[2]], "rows": [padded[3], packed[3]]}


def lean_parity(root: Path, results: dict) -> None:
    """Full logits vs the lean path (chunks of 5 tokens: several per micro-batch)."""
    for label, (layout, name, sp) in LEAN.items():
        for pack in (0, CAPACITY):
            full = run(root, layout, pack, "token-mean", 0, name, sp)
            lean = run(root, layout, pack, "token-mean", 5, name, sp)
            lp = None if full[0] is None else float((full[0] - lean[0]).abs().max())
            results[f"lean/{label}/{'packed' if pack else 'padded'}"] = {
                "logprob_diff": max_over_world(lp),
                "logprob_abs_max": max_over_world(None if full[0] is None else float(full[0].abs().max())),
                "grad_diff": max_over_world(float((full[4] - lean[4]).abs().max())),
                "grad_abs_max": max_over_world(float(full[4].abs().max())),
                "metrics_full": full[1], "metrics_lean": lean[1], "grad_norm": [full[2], lean[2]]}


# A micro-batch's logits then dwarf every other activation, and the [vocab x hidden] weight.
BIG_VOCAB = 4096


def big_vocab_policy(out: Path) -> Path:
    """A tiny Qwen2 with a 4096-token vocabulary, written by rank 0."""
    import torch.distributed as torch_dist
    from transformers import AutoModelForCausalLM

    from megatron_rlhf.models.tiny import tiny_config

    folder = out.parent / "big_vocab_policy"
    if torch_dist.get_rank() == 0:
        torch.manual_seed(0)
        config = tiny_config("qwen2", vocab_size=BIG_VOCAB, hidden_size=32)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    torch_dist.barrier()
    return folder


def largest_allocation(step) -> int:
    """Bytes of the largest block any single op allocated for itself while ``step()`` ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return max(e.self_cpu_memory_usage for e in prof.events())


def lean_memory(folder: Path, results: dict) -> None:
    """One update (forward, backward, optimizer) with full logits and with the lean path: the
    largest single allocation of each, against the bytes of one micro-batch's fp32 logits."""
    from megatron_rlhf.trainers.engine import make_trainable

    for label, layout in (("dp2", (1, 1)), ("tp2", (2, 1))):
        sizes = {}
        for chunk in (0, 8):
            model, groups, arch = from_hf(folder, layout)
            batch = make_batch()
            mine = list(range(batch["input_ids"].shape[0]))[groups.dp_rank::groups.layout.dp]
            cfg = ActorConfig(model_path="-")
            trainable = make_trainable(model, groups, cfg.optim, 1)
            out_head = (output_head(trainable.model, arch.vocab_size, groups.tp, groups.tp_rank, chunk)
                        if chunk else None)
            loss = lambda out, b: actor_loss(out, b, vocab_size=arch.vocab_size, groups=groups,  # noqa: E731
                                             cfg=cfg, kl_loss_coef=0.0, temperature=1.0,
                                             horizon=16, head=out_head)
            micro = micro_batches(batch, mine, len(mine), {"loss_weight": 1.0})
            tokens = max(m["input_ids"].numel() for m in micro)
            logits_bytes = tokens * arch.vocab_size // groups.layout.tp * 4
            sizes[chunk] = largest_allocation(
                lambda: train_step(trainable, micro, loss, hidden_states=bool(chunk)))
        results[f"lean_memory/{label}"] = {"full": max_over_world(sizes[0]),
                                           "lean": max_over_world(sizes[8]),
                                           "logits_bytes": max_over_world(logits_bytes)}


def attention_parity(root: Path, results: dict) -> None:
    """The model's SDPA core attention against megatron's local kernel on the same module: GQA
    (2 query heads per KV head), causal and with a packed block-diagonal mask, outputs and the
    gradients of q, k and v."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_rlhf.data.packing import pack_sequences

    for label, layout in (("tp1", (1, 1)), ("tp2", (2, 1))):
        model, groups, arch = from_hf(root / "qwen2_policy", layout)
        core = model.decoder.layers[0].self_attention.core_attention
        heads, groups_kv = core.num_attention_heads_per_partition, core.num_query_groups_per_partition
        generator = torch.Generator().manual_seed(5)
        mask = pack_sequences([[1] * 7, [1] * 5, [1] * 9], 21, 0).attention_mask  # [1, 1, 21, 21]
        diffs = []
        for attention_mask in (None, mask.expand(2, 1, 21, 21)):
            q = torch.randn(21, 2, heads, core.hidden_size_per_attention_head, generator=generator)
            k, v = (torch.randn(21, 2, groups_kv, q.shape[-1], generator=generator) for _ in "kv")
            outputs = []
            for forward in (type(core).forward, DotProductAttention.forward):
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                out = forward(core, *leaves, attention_mask)
                out.square().sum().backward()
                outputs.append([out, *(t.grad for t in leaves)])
            diffs += [float((a - b).abs().max() / b.abs().max().clamp(min=1)) for a, b in zip(*outputs)]
        results[f"attention/{label}"] = {"relative_diff": max_over_world(max(diffs)), "gqa": heads // groups_kv,
                                         "kind": type(core).__name__}


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
    lean_parity(root, results)
    budget_parity(root, results)
    attention_parity(root, results)
    lean_memory(big_vocab_policy(out), results)
    if dist.rank == 0:
        out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
