"""Advantage estimators and reward shaping. Pure tensor code: no process groups, no megatron.

Shapes: ``B`` sequences, ``T`` response positions. ``mask [B, T]`` is 1 on tokens the policy
generated (and is trained on) and 0 elsewhere: right padding, or, in multi-turn samples, tokens
that came from the environment between turns. Masked positions are skipped, not treated as steps.
"""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of ``x`` over ``mask``'s positions; what is elsewhere (even inf or NaN) is ignored."""
    x = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / std`` over masked positions (unbiased variance); masked-out entries -> 0."""
    mask = mask.to(x.dtype)
    mean = masked_mean(x, mask)
    count = mask.sum()
    var = ((x - mean) ** 2 * mask).sum() / (count - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


@torch.no_grad()
def compute_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over masked-in tokens.

    Args: ``rewards``, ``values``, ``mask``: ``[B, T]``.
    Returns: ``(advantages, returns)`` ``[B, T]``, zero where ``mask`` is 0. The value after the
    last valid token is 0 (the episode ends there).
    ``delta_t = r_t + gamma * V(next valid) - V_t``, ``A_t = delta_t + gamma * lam * A(next valid)``.
    """
    mask = mask.to(values.dtype)
    batch, length = rewards.shape
    next_value = torch.zeros(batch, dtype=values.dtype, device=values.device)
    next_advantage = torch.zeros_like(next_value)
    advantages = torch.zeros_like(values)
    for t in reversed(range(length)):
        valid = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = advantage * valid
        # Skipped (masked) positions pass the later token's value and advantage through.
        next_value = torch.where(valid > 0, values[:, t], next_value)
        next_advantage = torch.where(valid > 0, advantage, next_advantage)
    returns = (advantages + values) * mask
    return advantages, returns


@torch.no_grad()
def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go ``G_t = sum_{s >= t, s valid} gamma^(k(s) - k(t)) r_s``, ``k`` = valid-token index.

    ``[B, T] -> [B, T]``; masked positions get 0 and do not count as discounting steps.
    """
    mask = mask.to(rewards.dtype)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    out = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        valid = mask[:, t]
        updated = rewards[:, t] + gamma * running
        running = torch.where(valid > 0, updated, running)
        out[:, t] = running * valid
    return out


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row of ``mask [B, T]`` -> ``[B]`` (0 for an empty row)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return (positions * (mask > 0)).max(dim=1).values


def token_level_rewards(scores: torch.Tensor, mask: torch.Tensor,
                        kl: torch.Tensor | None = None, kl_coef: float = 0.0) -> torch.Tensor:
    """Sequence scores ``[B]`` on each response's last valid token, minus ``kl_coef * kl [B, T]``."""
    rewards = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    rows = torch.arange(mask.shape[0], device=mask.device)
    rewards[rows, last_token_index(mask)] = scores
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl * mask.to(rewards.dtype)
    return rewards


def turn_rewards(turn_scores: list[list[float]], turn_ends: list[list[int]],
                 length: int) -> torch.Tensor:
    """Multi-turn: each turn's score on that turn's last token. Lists per sample -> ``[B, T]``."""
    rewards = torch.zeros(len(turn_scores), length)
    for row, (scores, ends) in enumerate(zip(turn_scores, turn_ends)):
        for score, end in zip(scores, ends):
            rewards[row, end] += score
    return rewards


def group_normalized_advantages(scores: torch.Tensor, group_ids: torch.Tensor,
                                norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: ``(score - mean of its group) / (std of its group)``; ``[N] -> [N]``.

    Groups are the samples drawn for one prompt; a group of one gets advantage 0.
    """
    out = torch.zeros_like(scores)
    for group in torch.unique(group_ids):
        members = group_ids == group
        values = scores[members]
        if values.numel() < 2:
            continue
        centred = values - values.mean()
        out[members] = centred / (values.std() + eps) if norm_by_std else centred
    return out


def rloo_advantages(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO: score minus the mean of the *other* samples of its prompt; ``[N] -> [N]``.

    A group of one has no other sample and gets advantage 0.
    """
    out = torch.zeros_like(scores)
    for group in torch.unique(group_ids):
        members = group_ids == group
        values = scores[members]
        count = values.numel()
        if count < 2:
            continue
        out[members] = values - (values.sum() - values) / (count - 1)
    return out


def group_mean_baseline(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Score minus the mean of its group (its prompt's samples, itself included); a group of one
    keeps its score, as verl's REINFORCE++-baseline. ``[N] -> [N]``."""
    out = scores.clone()
    for group in torch.unique(group_ids):
        members = group_ids == group
        if int(members.sum()) > 1:
            out[members] = scores[members] - scores[members].mean()
    return out


@torch.no_grad()
def reinforce_pp_advantages(rewards: torch.Tensor, mask: torch.Tensor,
                            gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262): the token rewards' (score on the last token,
    any in-reward KL on every token) discounted return-to-go, whitened over the whole batch's
    response tokens. No critic and no group: the batch is the baseline. ``[B, T]`` -> (advantages,
    returns) ``[B, T]``."""
    returns = discounted_returns(rewards, mask, gamma)
    return masked_whiten(returns, mask) * mask, returns


@torch.no_grad()
def reinforce_pp_baseline_advantages(scores: torch.Tensor, group_ids: torch.Tensor,
                                     mask: torch.Tensor) -> torch.Tensor:
    """REINFORCE++-baseline: each score minus its group's mean (:func:`group_mean_baseline`),
    broadcast to its response tokens, then whitened over the batch's tokens (not per group, the
    difference from GRPO). ``scores [N]``, ``mask [N, T]`` -> ``[N, T]``."""
    per_token = group_mean_baseline(scores, group_ids)[:, None] * mask
    return masked_whiten(per_token, mask) * mask
