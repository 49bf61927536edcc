"""The PPO worker with ``actor.lora`` and ``critic.lora``: a section of tests/dist_lora.py's
torchrun world (2 ranks: TP2), asserted on by tests/test_lora.py.

One :class:`PPOWorker` is built as a PPO run builds it; on a batch the engine generated it
computes old and reference log-probs, values, and trains actor and critic on made-up advantages
for a few steps; the weights are synced into the engine and its log-probs of its own greedy
samples compared with the trainer's. Then a save / more steps / load / the same steps again
round checks the checkpoints hold everything a resume needs (with the plain optimizer here; the
distributed optimizer's exact resume is dist_lora.py's ``resume`` section).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rlhf.config.loader import load_config
from megatron_rlhf.config.parallel import layout_of
from megatron_rlhf.config.ppo_checks import validate_ppo_config
from megatron_rlhf.config.ppo_schema import PPOConfig
from megatron_rlhf.models.lora import adapters
from megatron_rlhf.rollout.base import SamplingParams
from megatron_rlhf.trainers.rl.experience import build_batch, engine_logprobs
from megatron_rlhf.trainers.rl.policy import policy_files
from megatron_rlhf.trainers.rl.worker import PPOWorker

PROMPTS = [[5, 17, 33, 8, 90], [44, 2, 61, 7, 19, 23, 120, 3], [12, 9, 200], [7, 7, 31, 64]]


def ppo_config(workspace: Path, *extra: str, model: Path | None = None) -> PPOConfig:
    data = workspace / "data"
    return validate_ppo_config(load_config(PPOConfig, None, [
        f"actor.model_path={model or workspace / 'base'}",
        f"data.train_files=[{data / 'prompts_train.parquet'}]",
        "data.max_prompt_length=16", "data.max_response_length=8", "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_rank=2", "actor.ppo_epochs=1",
        "actor.optim.lr=5e-2", "actor.optim.min_lr=5e-2", "critic.optim.lr=1e-2", "reward.fn=addition",
        "algorithm.use_kl_in_reward=true", "actor.parallel.tp=2", "actor.lora.rank=4",
        "actor.lora.alpha=8",
        "critic.lora.rank=2", "trainer.logger=console", "trainer.seed=5", *extra]))


def _trainable_ids(trainable) -> set[int]:
    return {id(p) for group in trainable.optimizer.param_groups for p in group["params"]}


def _main_param_owners(trainable) -> set[int]:
    """The model parameters the optimizer updates (the distributed optimizer holds fp32 shards
    of them, mapped back through ``model_param_group_index_map``; fp32 parameters are their own
    main parameters)."""
    owned = set()
    for optimizer in getattr(trainable.optimizer, "chained_optimizers", [trainable.optimizer]):
        for param in getattr(optimizer, "model_param_group_index_map", {}):
            owned.add(id(param))
    return owned or _trainable_ids(trainable)


def _engine_vs_trainer(worker: PPOWorker, results: dict, label: str) -> dict:
    """Greedy samples of ``PROMPTS`` from this rank's engine (rank 0's, shared), then the
    trainer's old and reference log-probs of them; the gaps on rank 0."""
    params = SamplingParams(max_tokens=6, temperature=0.0, seed=1)
    gens = [worker.generator.generate(PROMPTS, params)]
    dist.broadcast_object_list(gens, src=0)
    batch = build_batch([tuple(p) for p in PROMPTS], gens[0], worker.pad_id)
    out = worker.compute_log_probs(batch, True, True)
    if out is not None and dist.get_rank() == 0:
        _, (old, ref, _, _) = out
        engine = engine_logprobs(gens[0], batch["loss_mask"])
        mask = batch["loss_mask"].bool()
        results[f"ppo/{label}/engine_vs_trainer"] = float((engine - old)[mask].abs().max())
        results[f"ppo/{label}/actor_vs_reference"] = float((old - ref)[mask].abs().max())
        results[f"ppo/{label}/engine_vs_reference"] = float((engine - ref)[mask].abs().max())
        results[f"ppo/{label}/logprob_abs_max"] = float(old[mask].abs().max())
    return batch


def _train(worker: PPOWorker, batch: dict, steps: range) -> list[dict]:
    """Made-up advantages and returns (seeded by the step), one actor and critic update each."""
    metrics = []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        mask = batch["loss_mask"]
        batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
        batch["returns"] = torch.randn(mask.shape, generator=g) * mask
        batch["values"] = torch.zeros_like(mask)
        metrics.append(worker.update_actor(batch, step, 0.0) | worker.update_critic(batch, step))
    return metrics


def _digest(worker: PPOWorker) -> str:
    """Every trained parameter of actor and critic on every rank (adapters and head)."""
    h = hashlib.sha256()
    for model in (worker.actor.module, worker.critic.module):
        for name, p in model.named_parameters():
            h.update(name.encode() + p.detach().float().numpy().tobytes())
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, h.hexdigest())
    return "".join(digests)


def ppo_with_lora(workspace: Path, work: Path, results: dict) -> None:
    cfg = ppo_config(workspace)
    layout = layout_of(cfg.actor.parallel).resolve(2, policy_files(cfg.actor.model_path)[0].shape)
    worker = PPOWorker(cfg, ("actor", "critic"), layout, {"actor": 8, "critic": 8})
    actor, critic = worker.actor.module, worker.critic.module
    results["ppo/reference_is_the_actor"] = float(worker.ref is actor)
    for role, model, extra in (("actor", actor, set()),
                               ("critic", critic, {id(critic.output_layer.weight)})):
        wanted = {id(p) for _, a in adapters(model) for p in (a.lora_a, a.lora_b)} | extra
        results[f"ppo/{role}/optimizer_holds_adapters_only"] = float(
            _main_param_owners(getattr(worker, role)) == wanted and len(wanted) > 2)
    base = {name: p.detach().clone() for name, p in actor.named_parameters()
            if ".adapter." not in name}
    worker.sync_weights()
    batch = _engine_vs_trainer(worker, results, "start")
    _train(worker, batch, range(1, 4))
    worker.sync_weights()
    _engine_vs_trainer(worker, results, "trained")
    results["ppo/base_bitwise_unchanged"] = float(all(
        torch.equal(p, base[name]) for name, p in actor.named_parameters() if name in base))
    root, saved = work / "ppo_ckpt", _digest(worker)
    worker.save(str(root), 3, {"step": 3})
    worker.finalize_saves(blocking=True)
    after = _train(worker, batch, range(4, 6)), _digest(worker)
    worker.load(str(root), 3, 1.0)
    results["ppo/loaded_weights_are_the_saved"] = float(_digest(worker) == saved)
    again = _train(worker, batch, range(4, 6)), _digest(worker)
    results["ppo/resume_metrics_equal"] = float(after[0] == again[0])
    results["ppo/resume_weights_bitwise"] = float(after[1] == again[1])

    results["ppo/resumed_steps_moved"] = float(after[1] != saved)
    if dist.get_rank() == 0:
        for role in ("actor", "critic"):
            meta = json.loads((root / role / "step_00000003/megatron_rlhf.json").read_text())
            results[f"ppo/{role}/checkpoint_lora_rank"] = float(meta.get("lora", {}).get("rank", 0))


def moe_ppo_with_lora(workspace: Path, families: Path, results: dict) -> None:
    """A GRPO actor of tiny Qwen3-MoE at TP2+SP x EP2 with adapters on every linear, routed
    experts included (each rank holds half the experts and their adapters): after three updates
    the engine, fed the merged weights gathered over TP and EP, scores its greedy samples as the
    trainer."""
    cfg = ppo_config(workspace, "actor.parallel.sequence_parallel=true", "actor.parallel.ep=2",
                     "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
                     "actor.use_kl_loss=true", "rollout.n=2", "critic.lora.rank=0",
                     model=families / "qwen3_moe")
    layout = layout_of(cfg.actor.parallel).resolve(2, policy_files(cfg.actor.model_path)[0].shape)
    worker = PPOWorker(cfg, ("actor",), layout, {"actor": 8})
    results["ppo_moe/expert_adapters"] = float(sum(
        ".local_experts." in name for name, _ in adapters(worker.actor.module)))
    worker.sync_weights()
    batch = _engine_vs_trainer(worker, results, "moe_start")
    for step in range(1, 4):
        g = torch.Generator().manual_seed(step)
        batch["advantages"] = torch.randn(batch["loss_mask"].shape, generator=g) * batch["loss_mask"]
        worker.update_actor(batch, step, 0.0)
    worker.sync_weights()
    _engine_vs_trainer(worker, results, "moe_trained")
