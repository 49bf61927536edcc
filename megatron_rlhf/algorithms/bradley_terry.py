"""Bradley-Terry pairwise loss for reward models. Pure tensor code: no process groups."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor,
                       margin: torch.Tensor | None = None,
                       center_coef: float = 0.0) -> torch.Tensor:
    """Per-pair loss ``-log sigmoid(r_c - r_r - margin) + center_coef * (r_c + r_r)^2``.

    Args:
        chosen, rejected: rewards ``[P]`` of the preferred / dispreferred response of each pair.
        margin: optional ``[P]`` required gap (e.g. from annotator scores), as in Llama 2.
        center_coef: weight of the reward-centering term (Eisenstein et al. 2023), which pins the
            otherwise shift-invariant rewards near zero mean.
    Returns:
        ``[P]`` losses (not reduced: the caller owns the reduction over ranks and micro-batches).
    """
    gap = chosen - rejected
    if margin is not None:
        gap = gap - margin
    loss = -F.logsigmoid(gap)
    if center_coef:
        loss = loss + center_coef * (chosen + rejected) ** 2
    return loss


def pair_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over ``[P]`` pairs (so they can be all-reduced): correct count, margin, reward moments."""
    return {
        "correct": (chosen > rejected).float().sum(),
        "margin": (chosen - rejected).sum(),
        "chosen": chosen.sum(),
        "chosen_sq": (chosen ** 2).sum(),
        "rejected": rejected.sum(),
        "rejected_sq": (rejected ** 2).sum(),
        "count": torch.tensor(float(chosen.numel())),
    }
