"""Correcting for the gap between the rollout engine's sampling probabilities and the trainer's.

The engine samples from ``pi_rollout`` (another kernel, bf16, a quantised model, a stale copy);
the update's importance ratio is taken against the trainer's ``pi_old``. Two corrections, both
on detached log-probs of the sampled tokens (pure tensor code, ``[B, T]`` with ``mask``):

* truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework secretly
  brings you off-policy RL training"): every token's loss is weighted by
  ``min(pi_old / pi_rollout, C)`` (``token``), or by its sequence's ratio, the product over its
  tokens, ``min(prod_t pi_old / pi_rollout, C)`` (``sequence``: verl's ``rollout_is=sequence``);
* sequence masking: samples whose ratio leaves ``[low, high]`` are left out of the loss,
  the ratio being the product over tokens (``sequence``) or its geometric mean (``geometric``,
  which does not shrink with length).
"""

from __future__ import annotations

import math

import torch

MASK_LEVELS = ("sequence", "geometric")
TIS_LEVELS = ("token", "sequence")


def tis_weights(old_logprob: torch.Tensor, rollout_logprob: torch.Tensor, mask: torch.Tensor,
                cap: float, level: str = "token") -> torch.Tensor:
    """Truncated importance weights, 0 off the mask, no gradient: ``[B, T]``. ``token``:
    ``min(exp(old - rollout), cap)`` per token; ``sequence``: ``min(exp(sum_t (old - rollout)),
    cap)`` on every token of the sequence (the sum taken over ``mask``)."""
    gap = (old_logprob - rollout_logprob).detach()
    if level == "token":
        return torch.exp(gap.clamp(min=-20.0, max=20.0)).clamp(max=cap) * mask
    if level != "sequence":
        raise ValueError(f"unknown TIS level {level!r}; choose from {TIS_LEVELS}")
    # Capped in log space: a long sequence's product of ratios overflows before the cap.
    log_ratio = (gap * mask).sum(dim=1, keepdim=True).clamp(max=math.log(cap))
    return torch.exp(log_ratio) * mask


def sequence_keep(old_logprob: torch.Tensor, rollout_logprob: torch.Tensor, mask: torch.Tensor,
                  low: float, high: float, level: str = "geometric") -> torch.Tensor:
    """Which samples' importance ratio ``pi_old / pi_rollout`` lies in ``[low, high]``:
    ``[B, T] -> [B]`` bool. An empty response is kept (it trains nothing anyway)."""
    log_ratio = ((old_logprob - rollout_logprob).detach() * mask).sum(dim=1)
    if level == "geometric":
        log_ratio = log_ratio / mask.sum(dim=1).clamp(min=1.0)
    elif level != "sequence":
        raise ValueError(f"unknown mask level {level!r}; choose from {MASK_LEVELS}")
    return (log_ratio >= torch.log(torch.tensor(low))) & (log_ratio <= torch.log(torch.tensor(high)))


def mismatch(old_logprob: torch.Tensor, rollout_logprob: torch.Tensor,
             mask: torch.Tensor) -> dict[str, float]:
    """How far the engine's log-probs are from the trainer's over the response tokens."""
    gap = (old_logprob - rollout_logprob).abs() * mask
    tokens = mask.sum().clamp(min=1.0)
    return {"rollout/logprob_diff_mean": float(gap.sum() / tokens),
            "rollout/logprob_diff_max": float(gap.max()) if gap.numel() else 0.0}
