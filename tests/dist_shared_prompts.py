"""Shared prompts against one copy per reply, run under torchrun (2 ranks) by
tests/test_shared_prompts.py.

A GRPO-like batch (three prompts of 4, 3 and 1 replies, replies of 1 to 12 tokens; one group
whose replies all start alike, so that more than the prompt is shared) goes through the actor
packed both ways, the same micro-batches: old log-probs (forward only), one
optimizer step of the PPO loss (metric sums, every gradient), then two more Adam steps (every
parameter). Layouts: DP=2, TP=2 with sequence parallelism, PP=2, DP=2 with full recompute, with
LoRA, with the distributed optimizer; Qwen3-MoE and DeepSeek-V3 (multi-latent attention, YaRN)
at EP=2 replaying recorded routing (R3), DeepSeek-V3 also under full recompute (its RoPE runs
inside the recomputed layers); DeepSeek-V3 of 5 layers at PP=2 (uneven stages).
A Bradley-Terry reward model's pairs, both sides sharing their prompt or not, at DP=2, TP=2 with
sequence parallelism and PP=2: both rewards, one step's gradients and metric sums.
Usage: torchrun --nproc-per-node 2 tests/dist_shared_prompts.py MODELS_ROOT FAMILIES_ROOT OUT.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist_parity import from_hf, max_over_world, write_results_and_leave  # noqa: E402

from megatron_rlhf.config.ppo_schema import ActorConfig  # noqa: E402
from megatron_rlhf.data.packing import grid_tensor  # noqa: E402
from megatron_rlhf.distributed.launch import init_distributed  # noqa: E402
from megatron_rlhf.models.forward import pipeline_forward  # noqa: E402
from megatron_rlhf.models.megatron_config import ModelOptions  # noqa: E402
from megatron_rlhf.rollout.base import Generation  # noqa: E402
from megatron_rlhf.trainers.engine import make_trainable, reduce_metrics, train_step  # noqa: E402
from megatron_rlhf.trainers.rl.experience import build_batch  # noqa: E402
from megatron_rlhf.trainers.rl.losses import actor_loss, grid_logprobs  # noqa: E402
from megatron_rlhf.trainers.rl.routing import own_routing, routing_replay  # noqa: E402
from megatron_rlhf.trainers.rl.micro_batches import dp_slice, micro_batches  # noqa: E402
from megatron_rlhf.trainers.rl.worker import ACTOR_KEYS  # noqa: E402

CAPACITY = 48
FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)
# label -> (model, layout (tp, pp, dp, ep), options, LoRA rank, distributed optimizer)
SCENARIOS = {
    "dp2": ("qwen2_policy", (1, 1), {}, 0, False),
    "tp2_sp": ("qwen2_policy", (2, 1), {"sequence_parallel": True}, 0, False),
    "pp2": ("qwen2_policy", (1, 2), {}, 0, False),
    "dp2_recompute": ("qwen2_policy", (1, 1), FULL_RECOMPUTE, 0, False),
    "dp2_lora": ("qwen2_policy", (1, 1), {}, 4, False),
    "dp2_distopt": ("qwen2_policy", (1, 1), {}, 0, True),
    "ep2_qwen3_moe": ("qwen3_moe", (1, 1, None, 2), {}, 0, False),
    "ep2_deepseek_v3": ("deepseek_v3", (1, 1, None, 2), {}, 0, False),
    "ep2_deepseek_v3_recompute": ("deepseek_v3", (1, 1, None, 2), FULL_RECOMPUTE, 0, False),
    "pp2_deepseek_v3_5l": ("deepseek_v3_5l", (1, 2), {}, 0, False),
}


def make_batch() -> dict:
    generator = torch.Generator().manual_seed(7)
    prompts = [tuple(torch.randint(3, 250, (n,), generator=generator).tolist()) for n in (9, 14, 5)]
    replies = [(0, 7), (0, 2), (0, 12), (0, 1), (1, 9), (1, 4), (1, 3), (2, 10)]
    gens = [Generation(p, torch.randint(3, 250, (n,), generator=generator).tolist(), [], True)
            for p, n in replies]
    for gen in gens[4:7]:  # the second group's replies all start with the same two tokens
        gen.tokens[:2] = [11, 12]
    batch = build_batch(prompts, gens, pad_id=0)
    shape = batch["loss_mask"].shape
    batch["old_logprobs"] = -torch.rand(shape, generator=generator) * 5 * batch["loss_mask"]
    batch["ref_logprobs"] = -torch.rand(shape, generator=generator) * 5 * batch["loss_mask"]
    batch["advantages"] = torch.randn(shape, generator=generator) * batch["loss_mask"]
    return batch


def _mine(batch: dict, groups) -> list[int]:
    count = batch["input_ids"].shape[0]
    return list(range(count))[dp_slice(count, groups.layout.dp, groups.dp_rank)]


def _micro(batch: dict, rows: list[int], share: bool, extra=None) -> list[dict]:
    """Micro-batches of four samples: every rank runs as many (expert parallelism's
    all-to-alls pair them up); the first holds the 4-reply group, the next the 3-reply group
    and the 1-reply one."""
    return micro_batches(batch, rows, 4, extra, CAPACITY, share)


def recorded_routing(model, groups, arch, replay, batch) -> torch.Tensor:
    """The routers' own choices in a shared pass (the prompt routed once per group), on the
    sample grid of every rank's rows, to replay in both layouts."""
    import torch.distributed as dist

    mine, width = _mine(batch, groups), batch["input_ids"].shape[1]
    micro = _micro(batch, mine, True)
    replay.start(False, True)
    try:
        pipeline_forward(model, groups, micro, lambda out, b: out[..., :1], replay=replay)
        own = own_routing(replay, groups, micro, width).long()
    finally:
        replay.stop()
    parts = [torch.zeros_like(own) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, own)
    return torch.cat(parts[::groups.layout.tp * groups.layout.pp] if groups.layout.dp > 1
                     else parts[:1]).to(torch.int16)


def run(roots: dict, label: str, share: bool, routing=None) -> dict:
    from megatron_rlhf.models.lora import LoRASpec, apply_lora

    name, layout, options, lora_rank, distopt = SCENARIOS[label]
    root = roots["families"] if name in ("qwen3_moe", "deepseek_v3", "deepseek_v3_5l") else roots["models"]
    moe = root is roots["families"]
    model, groups, arch = from_hf(root / name, layout,
                                  options=ModelOptions(moe_routing_replay=moe, **options))
    if lora_rank:
        apply_lora(model, LoRASpec(rank=lora_rank, alpha=8.0, seed=3))
    replay = routing_replay(model, arch, groups, options.get("sequence_parallel", False))
    batch = make_batch()
    if moe and routing is None:  # the routing both layouts replay
        return {"routing": recorded_routing(model, groups, arch, replay, batch)}
    if routing is not None:
        batch["routing"] = routing
    mine = _mine(batch, groups)
    micro = _micro(batch, mine, share)
    score = lambda out, b: grid_logprobs(out, b, arch.vocab_size, groups) * grid_tensor(b, "loss_mask")  # noqa: E731
    if replay is not None:
        replay.start(True, False)
    logprobs = pipeline_forward(model, groups, micro, score, replay=replay)
    width = batch["input_ids"].shape[1]
    logprobs = (torch.cat([torch.nn.functional.pad(x, (0, width - x.shape[1])) for x in logprobs])
                if logprobs else None)
    cfg = ActorConfig(model_path="-", entropy_coeff=0.01, use_kl_loss=True)
    cfg.optim.lr, cfg.optim.warmup_steps_ratio = 1e-4, 0.0
    trainable = make_trainable(model, groups, cfg.optim, 3, distopt)
    weight = len(micro) * groups.layout.dp / float(batch["loss_mask"].sum())
    loss = lambda out, b: actor_loss(out, b, vocab_size=arch.vocab_size, groups=groups, cfg=cfg,  # noqa: E731
                                     kl_loss_coef=0.1, temperature=1.0, horizon=16)
    out = {"logprobs": logprobs}
    before = torch.cat([p.detach().flatten() for p in trainable.model.parameters()])
    for step in range(3):
        result = train_step(trainable, _micro(batch, mine, share, {"loss_weight": weight}), loss,
                            replay=replay)
        if step == 0:
            out["metrics"] = reduce_metrics(result.metrics, groups, ACTOR_KEYS)
            out["grads"] = torch.cat([p.main_grad.flatten() for p in trainable.model.parameters()
                                      if p.requires_grad])
    if replay is not None:
        replay.stop()
    out["params"] = torch.cat([p.detach().flatten() for p in trainable.model.parameters()])
    out["moved"] = float((out["params"] - before).abs().max())
    out["computed"] = sum(m["packing"]["computed"] for m in micro) if share else None
    out["sample"] = sum(m["packing"]["sample"] for m in micro) if share else None
    return out


def compare(roots: dict, label: str) -> dict:
    routing = None
    if SCENARIOS[label][0] in ("qwen3_moe", "deepseek_v3", "deepseek_v3_5l"):
        routing = run(roots, label, True)["routing"]
    copies, shared = run(roots, label, False, routing), run(roots, label, True, routing)
    has = copies["logprobs"] is not None
    diff = lambda key: float((copies[key] - shared[key]).abs().max())  # noqa: E731
    return {"logprob_diff": max_over_world(diff("logprobs") if has else None),
            "logprob_abs_max": max_over_world(float(copies["logprobs"].abs().max()) if has else None),
            "grad_diff": max_over_world(diff("grads")),
            "grad_abs_max": max_over_world(float(copies["grads"].abs().max())),
            "param_diff": max_over_world(diff("params")),
            "param_moved": max_over_world(copies["moved"]),
            "metrics_copies": copies["metrics"], "metrics_shared": shared["metrics"],
            "computed": max_over_world(shared["computed"]), "sample": max_over_world(shared["sample"])}


def rm_run(root: Path, layout: tuple[tuple, bool], share: bool) -> dict:
    """A Bradley-Terry reward model (tiny Qwen2 with a value head): both sides' rewards, and one
    optimizer step's gradients and metric sums, over pairs packed with or without sharing."""
    from dist_parity import layout_groups

    from megatron_rlhf.config.schema import RMConfig
    from megatron_rlhf.data.preference import TokenizedPair
    from megatron_rlhf.trainers.rl.value_init import build_value_model, resolve_value_source
    from megatron_rlhf.trainers.rm import METRIC_KEYS, pair_batch, pair_rewards, rm_loss

    from megatron_rlhf.distributed.layout import ParallelLayout

    layout, sp = layout
    source = resolve_value_source(str(root / "qwen2_rm"), ParallelLayout(*layout))
    groups = layout_groups(layout, source.arch.shape)
    model = build_value_model(source, groups, torch.float32, 0, ModelOptions(sequence_parallel=sp))
    generator = torch.Generator().manual_seed(11)
    ids = lambda n: tuple(torch.randint(3, 250, (n,), generator=generator).tolist())  # noqa: E731
    pairs = []
    for prompt_len, chosen, rejected in ((9, 5, 3), (14, 2, 8), (5, 7, 7), (11, 1, 4)):
        prompt = ids(prompt_len)
        pairs.append(TokenizedPair(prompt + ids(chosen), prompt + ids(rejected)))
    config = RMConfig()
    config.data.max_prompt_length, config.data.max_response_length = 16, 16
    config.data.share_prompts = share
    mine = pairs[dp_slice(len(pairs), groups.layout.dp, groups.dp_rank)]
    micro = [pair_batch(mine[i:i + 1], config, 0) for i in range(len(mine))]
    rewards = pipeline_forward(model, groups, micro, lambda out, b: torch.cat(pair_rewards(out, b)))
    trainable = make_trainable(model, groups, config.optim, 1)
    result = train_step(trainable, micro, lambda out, b: rm_loss(out, b, config))
    return {"rewards": torch.cat(rewards) if rewards else None,
            "grads": torch.cat([p.main_grad.flatten() for p in trainable.model.parameters()]),
            "metrics": reduce_metrics(result.metrics, groups, METRIC_KEYS)}


def rm_compare(roots: dict, layout: tuple) -> dict:
    copies, shared = (rm_run(roots["models"], layout, share) for share in (False, True))
    has = copies["rewards"] is not None
    return {"reward_diff": max_over_world(float((copies["rewards"] - shared["rewards"]).abs().max())
                                          if has else None),
            "reward_abs_max": max_over_world(float(copies["rewards"].abs().max()) if has else None),
            "grad_diff": max_over_world(float((copies["grads"] - shared["grads"]).abs().max())),
            "grad_abs_max": max_over_world(float(copies["grads"].abs().max())),
            "metrics_copies": copies["metrics"], "metrics_shared": shared["metrics"]}


RM_LAYOUTS = {"rm_dp2": ((1, 1), False), "rm_tp2_sp": ((2, 1), True), "rm_pp2": ((1, 2), False)}


def main() -> None:
    roots = {"models": Path(sys.argv[1]), "families": Path(sys.argv[2])}
    out = Path(sys.argv[3])
    init_distributed()
    only = sys.argv[4].split(",") if len(sys.argv) > 4 else [*SCENARIOS, *RM_LAYOUTS]
    write_results_and_leave(out, {label: compare(roots, label) if label in SCENARIOS
                                  else rm_compare(roots, RM_LAYOUTS[label]) for label in only})


if __name__ == "__main__":
    main()
