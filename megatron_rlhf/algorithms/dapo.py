"""DAPO's pieces (Yu et al. 2025, arXiv 2503.14476) that are not a loss: dynamic sampling's
group filter and the overlong reward shaping. Pure tensor code.

Clip-higher (``actor.clip_ratio_high``) and the token-level loss (``loss_agg_mode=token-mean``)
are the PPO loss's own options; ``configs/ppo/dapo_tiny_cpu.yaml`` sets them.
"""

from __future__ import annotations

import torch


def groups_with_signal(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Which samples belong to a group whose scores are not all equal: ``[N] -> [N]`` bool.

    A group whose samples all scored the same (all right, all wrong) has zero advantage under
    any group baseline and only dilutes the batch; DAPO drops it and samples more prompts. A
    group of one has no spread and is dropped too.
    """
    keep = torch.zeros_like(group_ids, dtype=torch.bool)
    for group in torch.unique(group_ids):
        members = group_ids == group
        values = scores[members]
        keep[members] = bool(values.numel() > 1 and (values != values[0]).any())
    return keep


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (its eq. 13), added to the score: 0 up to
    ``max_length - buffer`` tokens, then falling linearly to ``-penalty_factor`` at
    ``max_length``. ``lengths [N]`` (response tokens) -> ``[N]``."""
    if not 0 < buffer <= max_length:
        raise ValueError(f"overlong buffer {buffer} must be in (0, max_length={max_length}]")
    exceed = lengths.to(torch.float32) - (max_length - buffer)
    return (-exceed / buffer * penalty_factor).clamp(max=0.0)
