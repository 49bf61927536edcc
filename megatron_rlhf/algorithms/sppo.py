"""Self-play preference optimisation (SPPO; Wu et al. 2024, arXiv 2405.00675). Pure tensor code.

For each prompt the policy samples ``K`` responses; a preference model gives
``P(y_i > y_j)``. Each response's win rate against the current policy is estimated from the
other samples of its prompt, ``P(y_i > pi) = mean_{j != i} P(y_i > y_j)``, and the policy
regresses its whole-sequence log-ratio onto ``eta * (P(y_i > pi) - 1/2)``:

    loss = mean_i (log pi(y_i|x) / pi_old(y_i|x) - eta * (P(y_i > pi) - 1/2))^2

With a Bradley-Terry reward model ``P(y_i > y_j) = sigmoid(r_i - r_j)``; with a rule-based
score a win is 1, a tie 1/2, a loss 0. verl's SPPO recipe instead regresses onto
``eta * (r_i - softmean_beta(r_group))``, the ``softmean`` target here.
"""

from __future__ import annotations

import math

import torch

PREFERENCES = ("bradley_terry", "rule")
TARGETS = ("win_rate", "softmean")


def pairwise_preferences(scores: torch.Tensor, kind: str) -> torch.Tensor:
    """``P[i, j] = P(y_i > y_j)`` for ``scores [N]`` -> ``[N, N]``. Exactly ``P[i, j] =
    1 - P[j, i]`` (the diagonal is 1/2), for either kind."""
    diff = scores[:, None] - scores[None, :]
    if kind == "bradley_terry":
        upper = torch.sigmoid(diff)
        # sigmoid(-x) computed as 1 - sigmoid(x), so the table is antisymmetric to the last bit.
        return torch.where(diff >= 0, upper, 1.0 - torch.sigmoid(-diff))
    if kind == "rule":
        return (diff > 0).to(scores.dtype) + 0.5 * (diff == 0).to(scores.dtype)
    raise ValueError(f"unknown preference kind {kind!r}; choose from {PREFERENCES}")


def win_rates(preferences: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``P(y_i > pi)``: mean of ``preferences[i, j]`` over the other samples ``j`` of ``i``'s
    group; 1/2 for a group of one. ``[N, N]``, ``[N]`` -> ``[N]``."""
    same = (group_ids[:, None] == group_ids[None, :]) & ~torch.eye(
        len(group_ids), dtype=torch.bool, device=group_ids.device)
    others = same.sum(dim=1)
    rates = (preferences * same).sum(dim=1) / others.clamp(min=1)
    return torch.where(others > 0, rates, torch.full_like(rates, 0.5))


def softmean(values: torch.Tensor, beta: float) -> torch.Tensor:
    """``log(mean(exp(beta * x))) / beta`` (the plain mean at ``beta = 0``) of ``values [K]``."""
    if beta == 0:
        return values.mean()
    return (torch.logsumexp(beta * values, dim=0) - math.log(values.numel())) / beta


def sppo_targets(scores: torch.Tensor, group_ids: torch.Tensor, eta: float, target: str,
                 preference: str = "rule", beta: float = 1.0, scope: str = "prompt") -> torch.Tensor:
    """Each response's regression target ``[N]``: ``eta * (P(y > pi) - 1/2)`` (``win_rate``) or
    ``eta * (r - softmean_beta(r))`` (``softmean``) with the soft mean over the response's own
    group (``scope="prompt"``) or over all ``N`` (``"batch"``, verl's SPPO recipe)."""
    if target == "win_rate":
        return eta * (win_rates(pairwise_preferences(scores, preference), group_ids) - 0.5)
    if target == "softmean" and scope == "batch":
        return eta * (scores - softmean(scores, beta))
    if target == "softmean":
        out = torch.zeros_like(scores)
        for group in torch.unique(group_ids):
            members = group_ids == group
            out[members] = scores[members] - softmean(scores[members], beta)
        return eta * out
    raise ValueError(f"unknown SPPO target {target!r}; choose from {TARGETS}")


def sppo_loss(old_logprob: torch.Tensor, logprob: torch.Tensor, targets: torch.Tensor,
              mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence ``(sum_t (log pi - log pi_old) - target)^2``: ``[B, T]``, targets ``[B]``
    -> ``[B]`` (0 for an empty response)."""
    gap = torch.where(mask.bool(), logprob - old_logprob, torch.zeros((), dtype=logprob.dtype))
    return (gap.sum(dim=1) - targets) ** 2 * (mask.sum(dim=1) > 0)
