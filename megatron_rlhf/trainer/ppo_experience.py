"""Turning rollouts into a PPO batch, and scores + KL into advantages. Pure tensor code.

All per-token tensors live on the *target grid*: position ``t`` of a ``[N, T]`` tensor belongs to
the token at ``t + 1`` (the one the logits at ``t`` predict), so log-probs, values, rewards and
advantages of the response tokens sit where ``loss_mask`` is 1.
"""

from __future__ import annotations

import torch

from megatron_rlhf.algorithms.advantages import masked_mean
from megatron_rlhf.algorithms.estimators import Inputs, estimator
from megatron_rlhf.algorithms.ppo import kl_estimate
from megatron_rlhf.config.ppo_schema import AlgorithmConfig
from megatron_rlhf.rollout.base import Generation


def build_batch(prompts: list[tuple[int, ...]], generations: list[Generation], pad_id: int) -> dict:
    """``input_ids``, ``targets``, ``loss_mask`` ``[N, T]``; ``lengths [N, 1]``; ``group [N]``.
    ``loss_mask`` is 0 on the environment's tokens of multi-turn samples."""
    sequences = [list(prompts[g.prompt_index]) + list(g.tokens) for g in generations]
    count, width = len(sequences), max(len(s) for s in sequences)
    input_ids = torch.full((count, width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(count, width)
    for row, (seq, gen) in enumerate(zip(sequences, generations)):
        input_ids[row, :len(seq)] = torch.tensor(seq)
        start = len(prompts[gen.prompt_index]) - 1
        loss_mask[row, start:start + len(gen.tokens)] = (1.0 if gen.mask is None else
                                                         torch.tensor(gen.mask, dtype=torch.float))
    targets = torch.full_like(input_ids, pad_id)
    targets[:, :-1] = input_ids[:, 1:]
    return {"input_ids": input_ids, "targets": targets, "loss_mask": loss_mask,
            "lengths": torch.tensor([[len(s)] for s in sequences]),
            "group": torch.tensor([g.prompt_index for g in generations])}


def compute_advantages(batch: dict, scores: torch.Tensor, cfg: AlgorithmConfig, kl_coef: float,
                       turns: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Rewards, advantages and returns ``[N, T]`` from sequence ``scores [N]`` and the batch's
    ``old_logprobs``, ``ref_logprobs`` (and ``values`` for GAE); the KL is 0 without both.
    ``turns [N, T]``: multi-turn samples' per-turn rewards on each turn's last token (their sum
    is part of ``scores``)."""
    mask = batch["loss_mask"]
    kl = torch.zeros_like(mask)
    if batch.get("old_logprobs") is not None and batch.get("ref_logprobs") is not None:
        kl = kl_estimate(batch["old_logprobs"], batch["ref_logprobs"], cfg.kl_penalty) * mask
    inputs = Inputs(scores, mask, batch["group"], kl, kl_coef, batch.get("values"), turns,
                    sppo_preference(cfg, batch))
    rewards, advantages, returns = estimator(cfg.adv_estimator).compute(inputs, cfg)
    return {"rewards": rewards, "advantages": advantages, "returns": returns, "kl": kl}


def sppo_preference(cfg: AlgorithmConfig, batch: dict) -> str:
    """``algorithm.sppo_preference``, with ``auto`` resolved: Bradley-Terry for a reward
    model's scores (the driver marks them in ``batch["scores_from_rm"]``), else rule."""
    if cfg.sppo_preference != "auto":
        return cfg.sppo_preference
    return "bradley_terry" if batch.get("scores_from_rm") else "rule"


def sample_kl(kl: torch.Tensor, mask: torch.Tensor) -> float:
    """What the adaptive controller tracks, as verl: each response's mean per-token KL
    ``[N, T] -> [N]``, averaged over the responses."""
    per_sample = (kl * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
    return float(per_sample.mean())


def token_kl(kl: torch.Tensor, mask: torch.Tensor) -> float:
    return float(masked_mean(kl, mask))
