"""The actor's policy losses, one registry: ``POLICY_LOSS_REGISTRY[actor.policy_loss]``.

Each entry's ``compute(old, logprob, advantages, mask, settings, clip, agg_mode, weights,
horizon)`` takes ``[B, T]`` tensors on the sample grid and returns a
:class:`~megatron_rlhf.algorithms.ppo.PolicyLossOutput`; ``settings`` is any object with the
``actor.*`` fields an entry reads (``clip_ratio_c``, ``sppo_eta``). The config checks list the
names from here and :func:`clip_range` takes each loss's own default clip; adding a loss is one
entry here plus its test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from megatron_rlhf.algorithms.advantages import masked_mean
from megatron_rlhf.algorithms.ppo import (PolicyLossOutput, aggregate, gspo_policy_loss, policy_loss,
                                          reinforce_policy_loss)
from megatron_rlhf.algorithms.sppo import sppo_loss


def _vanilla(old, logprob, advantages, mask, s, clip, agg_mode, weights, horizon) -> PolicyLossOutput:
    return policy_loss(old, logprob, advantages, mask, clip[0], clip[1], s.clip_ratio_c or None,
                       agg_mode, weights, horizon)


def _gspo(old, logprob, advantages, mask, s, clip, agg_mode, weights, horizon) -> PolicyLossOutput:
    return gspo_policy_loss(old, logprob, advantages, mask, clip[0], clip[1], agg_mode, weights,
                            horizon)


def _reinforce(old, logprob, advantages, mask, s, clip, agg_mode, weights, horizon) -> PolicyLossOutput:
    return reinforce_policy_loss(old, logprob, advantages, mask, agg_mode, weights, horizon)


def _sppo(old, logprob, advantages, mask, s, clip, agg_mode, weights, horizon) -> PolicyLossOutput:
    """SPPO's per-sequence squared gap, meaned over the micro-batch's responses: spread evenly
    over each response's tokens, so every seq-mean-* aggregation (and its denominator) gives it."""
    tokens = mask.sum(dim=1).clamp(min=1.0)
    targets = (advantages * mask).sum(dim=1) / tokens  # the same value on every token
    per_sequence = sppo_loss(old, logprob, s.sppo_eta * targets, mask)
    loss = aggregate(per_sequence[:, None] * mask / tokens[:, None], mask, "seq-mean-token-sum")
    return PolicyLossOutput(loss, torch.zeros(()), masked_mean(old - logprob, mask), torch.zeros(()))


@dataclass(frozen=True)
class PolicyLoss:
    name: str
    compute: Callable[..., PolicyLossOutput]
    default_clip: tuple[float, float] | None = None  # None: actor.clip_ratio on both sides
    doc: str = ""


POLICY_LOSS_REGISTRY = {p.name: p for p in (
    PolicyLoss("vanilla", _vanilla, doc="PPO's clipped surrogate with dual clip"),
    # GSPO's ratio is a per-token geometric mean, three orders of magnitude closer to 1.
    PolicyLoss("gspo", _gspo, default_clip=(3e-4, 4e-4), doc="sequence-level importance ratio"),
    PolicyLoss("sppo", _sppo, doc="squared gap of the sequence log-ratio to SPPO's target"),
    # Set by algorithm.rollout_correction.bypass_loss=reinforce (the old log-probs are the engine's).
    PolicyLoss("reinforce", _reinforce, doc="-A * log pi on the engine's samples (verl's bypass)"),
)}
POLICY_LOSSES = tuple(POLICY_LOSS_REGISTRY)


def clip_range(settings) -> tuple[float, float]:
    """(low, high) clip of the importance ratio: ``clip_ratio_low/high`` when set, else the
    loss's own default (``clip_ratio`` on both sides unless the loss has one)."""
    default = (POLICY_LOSS_REGISTRY[settings.policy_loss].default_clip
               or (settings.clip_ratio, settings.clip_ratio))
    return (default[0] if settings.clip_ratio_low is None else settings.clip_ratio_low,
            default[1] if settings.clip_ratio_high is None else settings.clip_ratio_high)
