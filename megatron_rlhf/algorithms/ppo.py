"""PPO losses, KL estimators and KL controllers. Pure tensor code: no process groups.

Shapes: ``[B, T]`` per-token tensors with ``mask [B, T]`` (1 = trained token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_rlhf.algorithms.advantages import masked_mean

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
             "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "abs", "k2", "mse", "k3", "low_var_kl")


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str,
              horizon: int | None = None) -> torch.Tensor:
    """Reduce a ``[B, T]`` loss to a scalar.

    token-mean: mean over all valid tokens (DAPO's token-level loss); token-sum: their sum;
    seq-mean-token-sum: per-sequence sum, then mean over sequences; seq-mean-token-mean:
    per-sequence mean, then mean over sequences (GRPO's); seq-mean-token-sum-norm: per-sequence
    sum divided by the constant ``horizon`` (the generation budget), then mean over sequences
    (Dr. GRPO: no length normalisation, a constant scale instead). The sequence means count only
    rows with at least one valid token (an empty response trains nothing and does not dilute the
    others), as verl's ``agg_loss``.
    """
    # Masked positions are zeroed, not multiplied by 0: a non-finite value there (a padded
    # position's inf log-ratio) must not turn the loss into NaN.
    loss = torch.where(mask.bool(), loss, torch.zeros((), dtype=loss.dtype, device=loss.device))
    mask = mask.to(loss.dtype)
    if mode == "token-mean":
        return masked_mean(loss, mask)
    if mode == "token-sum":
        return (loss * mask).sum()
    tokens = mask.sum(dim=1)
    if mode == "seq-mean-token-sum":
        return (loss * mask).sum(dim=1).sum() / nonempty_rows(mask)
    if mode == "seq-mean-token-mean":
        return ((loss * mask).sum(dim=1) / tokens.clamp(min=1)).sum() / nonempty_rows(mask)
    if mode == "seq-mean-token-sum-norm":
        if not horizon or horizon < 1:
            raise ValueError("seq-mean-token-sum-norm needs the constant horizon (max length)")
        return (loss * mask).sum(dim=1).sum() / (nonempty_rows(mask) * horizon)
    raise ValueError(f"unknown loss aggregation {mode!r}; choose from {AGG_MODES}")


def aggregate_denominator(mask: torch.Tensor, mode: str, horizon: int | None = None) -> torch.Tensor:
    """What :func:`aggregate` divides the masked sum of ``[B, T]`` by for ``mode``: tokens,
    non-empty sequences (times the horizon), or 1 (token-sum). Summed over micro-batches it is
    the mini-batch's own, which is how losses computed in pieces add up to the whole's."""
    if mode == "token-mean":
        return mask.sum().clamp(min=1.0)
    if mode == "token-sum":
        return torch.tensor(1.0)
    if mode == "seq-mean-token-sum-norm":
        return nonempty_rows(mask) * float(horizon)
    return nonempty_rows(mask)


def nonempty_rows(mask: torch.Tensor) -> torch.Tensor:
    """Rows of ``mask [B, T]`` with a valid token, at least 1: the sequence means' denominator."""
    return (mask.sum(dim=1) > 0).sum().to(torch.float32).clamp(min=1.0)


def kl_estimate(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi; ``[B, T] -> [B, T]``.

    k1 = log r (unbiased, can be negative); abs = |log r|; k2/mse = (log r)^2 / 2;
    k3/low_var_kl = 1/r - 1 + log r with r = pi / pi_ref (unbiased, >= 0; Schulman 2020),
    clamped to [-10, 10] against exploding ratios.
    """
    log_ratio = logprob - ref_logprob
    if kind == "k1":
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind in ("k2", "mse"):
        return 0.5 * log_ratio ** 2
    if kind in ("k3", "low_var_kl"):
        neg = (-log_ratio).clamp(min=-20.0, max=20.0)
        return (torch.exp(neg) - neg - 1.0).clamp(min=-10.0, max=10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; choose from {KL_ESTIMATORS}")


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor
    clipfrac: torch.Tensor  # fraction of tokens where the clipped branch was taken
    approx_kl: torch.Tensor  # mean of old_logprob - logprob
    dual_clipfrac: torch.Tensor  # fraction where the dual clip bound was active


def policy_loss(old_logprob: torch.Tensor, logprob: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                dual_clip: float | None = 3.0, agg_mode: str = "token-mean",
                token_weights: torch.Tensor | None = None,
                horizon: int | None = None) -> PolicyLossOutput:
    """PPO clipped surrogate with separate low/high ranges and dual clip (Ye et al. 2020).

    ``L = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``; for ``A < 0`` additionally
    ``min(L, -A * dual_clip)``. All ``[B, T]``. ``token_weights [B, T]`` (no gradient) multiply
    each token's loss: the rollout correction's importance weights.
    """
    log_ratio = (logprob - old_logprob).clamp(min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    clip_used = (clipped > unclipped).to(loss.dtype)
    dual_used = torch.zeros_like(loss)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual clip constant must exceed 1, got {dual_clip}")
        bound = -advantages * dual_clip
        dual_used = ((advantages < 0) & (loss > bound)).to(loss.dtype)
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    if token_weights is not None:
        loss = loss * token_weights
    return PolicyLossOutput(aggregate(loss, mask, agg_mode, horizon), masked_mean(clip_used, mask),
                            masked_mean(-log_ratio, mask), masked_mean(dual_used, mask))


def reinforce_policy_loss(rollout_logprob: torch.Tensor, logprob: torch.Tensor,
                          advantages: torch.Tensor, mask: torch.Tensor,
                          agg_mode: str = "token-mean", token_weights: torch.Tensor | None = None,
                          horizon: int | None = None) -> PolicyLossOutput:
    """REINFORCE on the rollout policy's samples, no ratio and no clip: ``L = -A * log pi`` per
    token, times ``token_weights`` (detached importance weights) when given; verl's bypass-mode
    ``loss_type=reinforce`` (``compute_policy_loss_reinforce``). Its gradient ``-A w grad log pi``
    is PPO's wherever ``pi = pi_rollout`` (ratio 1, nothing clipped). ``approx_kl`` is the mean
    of ``log pi_rollout - log pi``. All ``[B, T]``."""
    loss = -advantages * logprob
    if token_weights is not None:
        loss = loss * token_weights
    zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
    return PolicyLossOutput(aggregate(loss, mask, agg_mode, horizon), zero,
                            masked_mean((rollout_logprob - logprob).detach(), mask), zero)


def sequence_log_ratio(old_logprob: torch.Tensor, logprob: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    """GSPO's length-normalised sequence log-ratio ``mean_t(log pi - log pi_old)``: ``[B, T] -> [B]``."""
    tokens = mask.sum(dim=1).clamp(min=1.0)
    gap = torch.where(mask.bool(), logprob - old_logprob, torch.zeros((), dtype=logprob.dtype))
    return gap.sum(dim=1) / tokens


def gspo_policy_loss(old_logprob: torch.Tensor, logprob: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor, clip_low: float = 3e-4, clip_high: float = 4e-4,
                     agg_mode: str = "seq-mean-token-mean",
                     token_weights: torch.Tensor | None = None,
                     horizon: int | None = None) -> PolicyLossOutput:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): one importance ratio per sequence,
    ``s_i = exp(mean_t log(pi / pi_old))``, clipped to ``[1 - clip_low, 1 + clip_high]`` (its
    own, much narrower range than PPO's). In the token form of its section 4.3 (as verl), each
    token carries ``s_i * pi_t / sg(pi_t)``: the value is ``s_i`` and the gradient flows through
    every token's own log-prob. ``[B, T]`` in, the sequence-mean loss out.
    """
    seq = sequence_log_ratio(old_logprob, logprob, mask).detach()
    log_ratio = (logprob - logprob.detach() + seq[:, None]).clamp(max=10.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    if token_weights is not None:
        loss = loss * token_weights
    clip_used = (clipped > unclipped).to(loss.dtype)
    return PolicyLossOutput(aggregate(loss, mask, agg_mode, horizon), masked_mean(clip_used, mask),
                            masked_mean(old_logprob - logprob, mask), torch.zeros(()))


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, cliprange_value: float | None = 0.5,
               agg_mode: str = "token-mean",
               horizon: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss ``0.5 * max((V - R)^2, (V_clip - R)^2)``; returns (loss, clipfrac)."""
    unclipped = (values - returns) ** 2
    if cliprange_value is None:
        return 0.5 * aggregate(unclipped, mask, agg_mode, horizon), torch.zeros(())
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    clipped = (clipped_values - returns) ** 2
    loss = 0.5 * aggregate(torch.maximum(unclipped, clipped), mask, agg_mode, horizon)
    return loss, masked_mean((clipped > unclipped).to(values.dtype), mask)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical over the last dim: ``[..., V] -> [...]``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over masked positions (nan if returns are constant)."""
    var_returns = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    residual = returns - values
    var_residual = masked_mean((residual - masked_mean(residual, mask)) ** 2, mask)
    return float(1.0 - var_residual / var_returns) if var_returns > 0 else math.nan


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        del current_kl, n_steps

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class AdaptiveKLController(FixedKLController):
    """Ziegler et al. 2019: steer the coefficient so the measured KL tracks ``target``.

    ``error = clip(KL / target - 1, -0.2, 0.2)``; ``coef *= 1 + error * n_steps / horizon``.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        super().__init__(init_kl_coef)
        self.target, self.horizon = target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
