"""Multi-agent training signals: the population's win-rate matrix and a proposer's reward.
Pure tensor code."""

from __future__ import annotations

import torch


def agent_win_matrix(preferences: torch.Tensor, group_ids: torch.Tensor, agent_ids: torch.Tensor,
                     num_agents: int) -> torch.Tensor:
    """``W[a, b]``: mean ``P(y_i > y_j)`` over pairs of samples of the same prompt with ``i``
    from agent ``a`` and ``j`` from agent ``b`` (``i != j``); ``preferences [M, M]``,
    ``group_ids [M]``, ``agent_ids [M]`` -> ``[A, A]``. NaN where two agents share no prompt
    (or an agent has a single sample on the diagonal)."""
    same = (group_ids[:, None] == group_ids[None, :]) & ~torch.eye(
        len(group_ids), dtype=torch.bool, device=group_ids.device)
    onehot = torch.nn.functional.one_hot(agent_ids, num_agents).to(preferences.dtype)  # [M, A]
    pairs = same.to(preferences.dtype)
    wins = onehot.T @ (preferences * pairs) @ onehot
    counts = onehot.T @ pairs @ onehot
    return wins / counts


def learnability(solve_rates: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """A proposer's reward per proposed task: ``1 - |2 s - 1|`` for a valid task the solver
    solves at rate ``s`` (1 at s = 1/2, 0 when always or never solved), 0 for an invalid one.
    ``[P]``, ``[P]`` bool -> ``[P]``."""
    return torch.where(valid, 1.0 - (2.0 * solve_rates - 1.0).abs(), torch.zeros_like(solve_rates))
