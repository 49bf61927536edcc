"""Turning rollouts into a PPO batch, and scores + KL into advantages. Pure tensor code.

All per-token tensors live on the *target grid*: position ``t`` of a ``[N, T]`` tensor belongs to
the token at ``t + 1`` (the one the logits at ``t`` predict), so log-probs, values, rewards and
advantages of the response tokens sit where ``loss_mask`` is 1.
"""

from __future__ import annotations

from typing import TypedDict

import torch

from megatron_rlhf.algorithms.advantages import masked_mean
from megatron_rlhf.algorithms.estimators import Inputs, estimator
from megatron_rlhf.algorithms.ppo import kl_estimate
from megatron_rlhf.config.ppo_schema import AlgorithmConfig
from megatron_rlhf.rollout.base import Generation


class Experience(TypedDict, total=False):
    """One agent's step of experience, as the driver builds it and the workers train on it.

    ``N`` samples (rows: responses, prompt-major), ``T`` positions on the target grid; every
    per-token tensor is zero where ``loss_mask`` is. Written by, in order:

    - :func:`build_batch`: ``input_ids``, ``targets``, ``loss_mask``, ``lengths``, ``group``;
    - ``PPORun.scores``: ``values`` (critic), ``scores_from_rm``;
    - ``PPORun.log_probs`` / ``correct``: ``old_logprobs``, ``ref_logprobs``, ``is_weights``,
      ``train_rows``;
    - ``RLRun.update``: ``advantages``, ``returns``; ``PPORun.leave_out_untrained``:
      ``response_mask`` (and a narrowed ``loss_mask``);
    - a population's play mode: ``preferences``, ``population_group``, ``population_rows``;
    - MoE routing replay: ``routing`` (:func:`build_batch` from the engine's, or the old pass's).
    """

    input_ids: torch.Tensor  # [N, T] long: prompt + response tokens, right-padded with pad_id
    targets: torch.Tensor  # [N, T] long: input_ids shifted left by one (the token predicted)
    loss_mask: torch.Tensor  # [N, T] float 0/1: the response tokens trained on
    lengths: torch.Tensor  # [N, 1] long: prompt + response tokens of each sample
    group: torch.Tensor  # [N] long: the prompt each sample answers (the group baselines' key)
    values: torch.Tensor | None  # [N, T] float: the critic's value per token (GAE), else None
    scores_from_rm: bool  # the scores came from a reward model (SPPO's Bradley-Terry)
    old_logprobs: torch.Tensor | None  # [N, T] float nats: the behaviour policy's (the actor's)
    ref_logprobs: torch.Tensor | None  # [N, T] float nats: the frozen reference's
    is_weights: torch.Tensor  # [N, T] float: truncated importance weights (rollout correction)
    train_rows: torch.Tensor  # [N] bool: samples the update may train on
    response_mask: torch.Tensor  # [N, T] float: every response, trained or not (statistics)
    advantages: torch.Tensor  # [N, T] float: per-token advantages
    returns: torch.Tensor  # [N, T] float: the critic's regression targets
    preferences: torch.Tensor  # [M, M] float: P(row beats column), over the population's M samples
    population_group: torch.Tensor  # [M] long: the prompt of each population sample
    population_rows: torch.Tensor  # [N] long: this agent's samples among the M
    routing: torch.Tensor  # [N, T, L, K] int16 on the *input* grid: the top-k experts of MoE
    #   layer L for the token at position t, as the rollout engine chose them (R3) or the old
    #   pass did (R2); -1 where unknown (padding, a sequence's last token, an offline sample)


EXPERIENCE_FIELDS = frozenset(Experience.__annotations__)


def check_experience(batch: dict, where: str) -> None:
    """Every key of ``batch`` is a declared :class:`Experience` field (a stage that writes a new
    one declares it there first)."""
    unknown = sorted(set(batch) - EXPERIENCE_FIELDS)
    if unknown:
        raise TypeError(f"{where}: the experience batch holds undeclared field(s) {unknown}; "
                        "declare them in megatron_rlhf.trainers.rl.experience.Experience")


def build_batch(prompts: list[tuple[int, ...]], generations: list[Generation], pad_id: int) -> Experience:
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
    batch = {"input_ids": input_ids, "targets": targets, "loss_mask": loss_mask,
             "lengths": torch.tensor([[len(s)] for s in sequences]),
             "group": torch.tensor([g.prompt_index for g in generations])}
    recorded = [g.routing for g in generations if g.routing is not None]
    if recorded:
        routing = torch.full((count, width, *recorded[0].shape[1:]), -1, dtype=torch.int16)
        for row, gen in enumerate(generations):
            if gen.routing is not None:
                routing[row, :len(gen.routing)] = gen.routing
        batch["routing"] = routing
    return batch


def engine_logprobs(gens: list[Generation], loss_mask: torch.Tensor) -> torch.Tensor:
    """The engine's log-probs of the sampled tokens on the batch's grid ``[N, T]`` (each
    response from its first loss position; 0 elsewhere)."""
    engine = torch.zeros(loss_mask.shape, dtype=torch.float32)
    for row, gen in enumerate(gens):
        if gen.tokens:  # an empty response has no position
            start = int(loss_mask[row].nonzero()[0])
            engine[row, start:start + len(gen.tokens)] = torch.tensor(gen.logprobs)
    return engine


def compute_advantages(batch: Experience, scores: torch.Tensor, cfg: AlgorithmConfig, kl_coef: float,
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


def sppo_preference(cfg: AlgorithmConfig, batch: Experience) -> str:
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
