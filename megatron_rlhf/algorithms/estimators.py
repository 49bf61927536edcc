"""The advantage estimators, one registry: each entry's function and what it needs.

``ESTIMATORS[name].compute(inputs, settings)`` turns a step's sequence scores (and per-token KL,
values, turns) into per-token ``rewards``, ``advantages`` and ``returns`` ``[N, T]``. The config
checks read ``needs_critic``, ``group_based`` and ``policy_loss`` from here, and the trainer
asks the entry whether to build and update a critic; adding an estimator is one entry here
plus its test. ``settings`` is any object with the fields of ``algorithm.*`` an entry reads
(gamma, lam, whiten_advantages, norm_adv_by_std_in_grpo, use_kl_in_reward, sppo_*).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from megatron_rlhf.algorithms.advantages import (compute_gae, group_normalized_advantages,
                                                 masked_whiten, reinforce_pp_advantages,
                                                 reinforce_pp_baseline_advantages, rloo_advantages,
                                                 token_level_rewards)
from megatron_rlhf.algorithms.sppo import sppo_targets


@dataclass
class Inputs:
    """One step's tensors. ``scores [N]``; ``mask``, ``kl`` ``[N, T]`` on the target grid;
    ``group [N]`` (prompt index); ``values [N, T]`` (critic estimators); ``turns [N, T]``:
    multi-turn samples' per-turn rewards (their sum is part of ``scores``)."""

    scores: torch.Tensor
    mask: torch.Tensor
    group: torch.Tensor
    kl: torch.Tensor
    kl_coef: float
    values: torch.Tensor | None = None
    turns: torch.Tensor | None = None
    preference: str = "rule"  # SPPO: how scores become pairwise preferences


Result = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # rewards, advantages, returns


@dataclass(frozen=True)
class Estimator:
    name: str
    compute: Callable[[Inputs, object], Result]
    needs_critic: bool = False  # values from a critic, which is then trained too
    group_based: bool = False  # compares the samples of a prompt: rollout.n >= 2
    policy_loss: str | None = None  # the actor.policy_loss it requires, if any
    doc: str = ""


def _token_rewards(x: Inputs, s) -> torch.Tensor:
    rest = x.scores if x.turns is None else x.scores - x.turns.sum(dim=1)
    rewards = token_level_rewards(rest, x.mask, x.kl if s.use_kl_in_reward else None, x.kl_coef)
    return rewards if x.turns is None else rewards + x.turns


def _gae(x: Inputs, s) -> Result:
    rewards = _token_rewards(x, s)
    advantages, returns = compute_gae(rewards, x.values, x.mask, s.gamma, s.lam)
    if s.whiten_advantages:
        advantages = masked_whiten(advantages, x.mask)
    return rewards, advantages, returns


def _reinforce_pp(x: Inputs, s) -> Result:
    rewards = _token_rewards(x, s)
    advantages, returns = reinforce_pp_advantages(rewards, x.mask, s.gamma)
    return rewards, advantages, returns


def _sequence_level(per_sample: Callable[[torch.Tensor, Inputs, object], torch.Tensor],
                    per_token: bool = False) -> Callable[[Inputs, object], Result]:
    """Estimators on sequence scores: the KL enters as a score penalty; ``per_sample`` gives
    ``[N]`` (spread over the response's tokens) or, with ``per_token``, ``[N, T]``."""

    def compute(x: Inputs, s) -> Result:
        scores = x.scores - x.kl_coef * x.kl.sum(dim=1) if s.use_kl_in_reward else x.scores
        found = per_sample(scores, x, s)
        advantages = found if per_token else found[:, None] * x.mask
        return token_level_rewards(scores, x.mask), advantages, advantages

    return compute


ESTIMATORS = {e.name: e for e in (
    Estimator("gae", _gae, needs_critic=True, doc="GAE with a learned value baseline"),
    Estimator("grpo", _sequence_level(lambda sc, x, s: group_normalized_advantages(
        sc, x.group, s.norm_adv_by_std_in_grpo)), group_based=True,
        doc="score minus its prompt's mean (over its std)"),
    Estimator("rloo", _sequence_level(lambda sc, x, s: rloo_advantages(sc, x.group)),
              group_based=True, doc="score minus the mean of the prompt's other samples"),
    Estimator("reinforce_plus_plus", _reinforce_pp,
              doc="discounted returns whitened over the batch"),
    Estimator("reinforce_plus_plus_baseline", _sequence_level(
        lambda sc, x, s: reinforce_pp_baseline_advantages(sc, x.group, x.mask), per_token=True),
        group_based=True, doc="group mean baseline, then whitened over the batch"),
    Estimator("sppo", _sequence_level(lambda sc, x, s: sppo_targets(
        sc, x.group, 1.0, s.sppo_target, x.preference, s.sppo_beta, s.sppo_softmean_scope)),
        group_based=True, policy_loss="sppo",
        doc="SPPO's regression target per sample (actor.sppo_eta scales it)"),
)}


def estimator(name: str) -> Estimator:
    return ESTIMATORS[name]
