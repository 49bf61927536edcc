"""MoE routing replay scenarios (R3, R2), run under torchrun (2 ranks) by tests/test_routing_replay.py.

For a tiny Qwen3-MoE and a tiny DeepSeek-V3 (group-limited sigmoid routing with expert bias) at
EP=2, PP=2 and TP=2 with sequence parallelism (and EP=2 with full activation recompute): a
bfloat16 ``hf`` engine generates and records its routing; the float32 Megatron model then
scores the samples (packed micro-batches, as the PPO worker cuts them)

- without replay, recording its own routing: ``agreement`` with the engine's, and the mean
  |log-prob gap| to the engine;
- with R3: the experts megatron's routers actually used (their routing maps, caught by forward
  hooks, in forward and in recompute inside backward) against the engine's, the log-prob gap,
  and one optimizer step (the routers' weights must move);
- R2: the routing recorded without replay, replayed: the used experts against it.

Usage: torchrun --nproc-per-node 2 tests/dist_routing.py FAMILIES_ROOT OUT.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist_parity import from_hf, max_over_world, write_results_and_leave  # noqa: E402

from megatron_rlhf.distributed.launch import init_distributed  # noqa: E402
from megatron_rlhf.models.megatron_config import ModelOptions  # noqa: E402
from megatron_rlhf.models.routing_replay import routing_agreement  # noqa: E402
from megatron_rlhf.rollout.base import SamplingParams  # noqa: E402
from megatron_rlhf.rollout.hf_engine import HFGenerator  # noqa: E402
from megatron_rlhf.trainers.rl.experience import build_batch, engine_logprobs  # noqa: E402
from megatron_rlhf.trainers.rl.routing import own_routing, routing_replay  # noqa: E402
from megatron_rlhf.trainers.rl.micro_batches import micro_batches  # noqa: E402

# label -> (tp, pp, dp, ep), sequence parallel, full recompute
LAYOUTS = {"ep2": ((1, 1, None, 2), False, False), "pp2": ((1, 2), False, False),
           "tp2sp": ((2, 1), True, False), "ep2_recompute": ((1, 1, None, 2), False, True)}
MODELS = ("qwen3_moe", "deepseek_v3")
PROMPTS = [[5, 17, 33, 8, 90], [44, 2, 61, 7, 19, 23, 120, 3, 77], [12, 9, 200, 14]]


def engine_samples(hf_dir: Path):
    """A bfloat16 engine's samples of PROMPTS with their routing (the same on every rank)."""
    from transformers import AutoModelForCausalLM

    engine = HFGenerator(str(hf_dir), torch.bfloat16, 0, 1)
    engine.load_weights(AutoModelForCausalLM.from_pretrained(hf_dir).state_dict().items())
    gens = engine.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=1.0, n=4, seed=5,
                                                   routed_experts=True))
    return gens, build_batch(PROMPTS, gens, 0)


class UsedExperts:
    """The experts megatron's routers used (``routing_map`` of each router's forward), kept as
    top-k ids per forward, separately for forwards and for recomputes inside backward."""

    def __init__(self, model, topk: int):
        from megatron.core.transformer.moe.router import TopKRouter

        self.topk, self.forward, self.backward = topk, {}, {}
        self.hooks = [r.register_forward_hook(self._hook(slot)) for slot, r in
                      enumerate(m for m in model.modules() if isinstance(m, TopKRouter))]

    def _hook(self, slot):
        def keep(_module, _args, output):
            ids = output[1].float().topk(self.topk, dim=-1).indices.detach().cpu()
            store = self.forward if torch._C._current_graph_task_id() == -1 else self.backward
            store.setdefault(slot, []).append(ids)
        return keep

    def remove(self):
        for hook in self.hooks:
            hook.remove()


def as_grid(replay, groups, micro, rows, width, recorded):
    """Per-router lists of top-k ids (one per recorded forward) on the sample grid, through the
    same path as the routers' own choices (:func:`own_routing`)."""
    saved = replay.recorded
    replay.recorded = [recorded.get(slot, []) for slot in range(len(replay.routers))]
    try:
        return own_routing(replay, groups, micro, width)
    finally:
        replay.recorded = saved


def scored_pass(model, groups, arch, replay, micro, rows, width, replay_on: bool):
    """Log-probs ``[N, T]`` (every rank) and the routers' own and used routing of one pass."""
    from megatron_rlhf.data.packing import grid_tensor
    from megatron_rlhf.models.forward import pipeline_forward
    from megatron_rlhf.trainers.rl.losses import grid_logprobs

    used = UsedExperts(model, arch.moe.topk)
    replay.start(replay_on, True)
    try:
        outs = pipeline_forward(model, groups, micro, lambda out, b: grid_logprobs(
            out, b, arch.vocab_size, groups) * grid_tensor(b, "loss_mask"), replay=replay)
        own = own_routing(replay, groups, micro, width)
    finally:
        replay.stop()  # the recorded shapes stay until the next start
        used.remove()
    used_grid = as_grid(replay, groups, micro, rows, width, used.forward)
    logprobs = torch.zeros(len(rows), width)
    if outs:
        logprobs = torch.cat([torch.nn.functional.pad(o, (0, width - o.shape[1])) for o in outs])
    logprobs = _from_last_stage(logprobs, groups, bool(outs))
    return logprobs, own, used_grid


def _from_last_stage(tensor, groups, mine: bool):
    """The last pipeline stage's tensor on every rank of the pipeline."""
    if groups.layout.pp == 1:
        return tensor
    tensor = tensor if mine else torch.zeros_like(tensor)
    dist.all_reduce(tensor, group=groups.pp)
    return tensor


def gap(logprobs, engine, mask) -> float:
    return float(((logprobs - engine).abs() * mask).sum() / mask.sum())


def scenario(hf_dir: Path, label: str, results: dict) -> None:
    from megatron_rlhf.config.schema import OptimConfig
    from megatron_rlhf.trainers.engine import make_trainable, train_step
    from megatron_rlhf.trainers.rl.losses import grid_logprobs

    layout, sp, recompute = LAYOUTS[label]
    gens, batch = engine_samples(hf_dir)
    options = ModelOptions(sequence_parallel=sp, moe_routing_replay=True,
                           recompute_granularity="full" if recompute else None,
                           recompute_method="uniform" if recompute else None,
                           recompute_num_layers=1 if recompute else None)
    model, groups, arch = from_hf(hf_dir, layout, options=options)
    replay = routing_replay(model, arch, groups, sp)
    rows, width = list(range(len(gens))), batch["input_ids"].shape[1]
    micro = micro_batches(batch, rows, 6, pack_capacity=64)
    engine, mask, engine_routing = engine_logprobs(gens, batch["loss_mask"]), batch["loss_mask"], batch["routing"]
    key = f"{hf_dir.name}/{label}"

    lp_none, own_none, _ = scored_pass(model, groups, arch, replay, micro, rows, width, False)
    lp_r3, _, used_r3 = scored_pass(model, groups, arch, replay, micro, rows, width, True)
    known = (engine_routing >= 0).all(-1)
    results[f"{key}/agreement_none"] = routing_agreement(own_none, engine_routing)[0]
    results[f"{key}/known_pairs"] = float(known.sum())
    results[f"{key}/r3_used_equals_engine"] = routing_agreement(used_r3, engine_routing)[0]
    results[f"{key}/gap_none"] = gap(lp_none, engine, mask)
    results[f"{key}/gap_r3"] = gap(lp_r3, engine, mask)

    # R2: the routing recorded without replay, replayed.
    r2_micro = micro_batches({**batch, "routing": own_none}, rows, 6, pack_capacity=64)
    _, _, used_r2 = scored_pass(model, groups, arch, replay, r2_micro, rows, width, True)
    valid = (own_none >= 0).all(-1)
    results[f"{key}/r2_used_equals_recorded"] = float(
        (used_r2.sort(-1).values == own_none.sort(-1).values).all(-1)[valid].all())

    # One optimizer step replaying the engine's routing: the routers still learn; under
    # recompute the routers re-run inside backward replay the same experts.
    trainable = make_trainable(model, groups, OptimConfig(lr=1e-2, warmup_steps_ratio=0.0), 1)
    routers = {n: p.detach().clone() for n, p in model.named_parameters() if "router" in n}
    used = UsedExperts(model, arch.moe.topk)

    def loss_fn(output, b):
        logprobs = grid_logprobs(output, b, arch.vocab_size, groups)
        loss = -(logprobs * b["grid"]["loss_mask"]).sum() / b["grid"]["loss_mask"].sum()
        return loss, {"loss": loss.detach()}

    replay.start(True, True)
    try:
        train_step(trainable, micro, loss_fn, replay=replay)
    finally:
        replay.stop()
        used.remove()
    moved = [float(not torch.equal(p.detach(), routers[n])) for n, p in model.named_parameters()
             if n in routers]
    results[f"{key}/routers_moved_fraction"] = -max_over_world(-min(moved)) if moved else 1.0
    results[f"{key}/train_used_equals_engine"] = routing_agreement(
        as_grid(replay, groups, micro, rows, width, used.forward), engine_routing)[0]
    if recompute:
        results[f"{key}/recompute_used_equals_engine"] = routing_agreement(
            as_grid(replay, groups, micro, rows, width, used.backward), engine_routing)[0]


def main() -> None:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    init_distributed()
    results: dict[str, float] = {}
    for name in MODELS:
        for label in LAYOUTS:
            scenario(root / name, label, results)
    write_results_and_leave(out, results)


if __name__ == "__main__":
    main()
