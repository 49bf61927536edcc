"""Rule-based (verifiable) rewards by name: ``reward.fn=addition``.

A reward function maps (decoded response, ground truth) to a float. Register more with
:func:`register`; a name that is not registered is a config error at start-up.
"""

from __future__ import annotations

from typing import Callable

from megatron_rlhf.data.tasks import check_answer
from megatron_rlhf.errors import UserError

RewardFn = Callable[[str, str], float]
_REGISTRY: dict[str, RewardFn] = {"addition": check_answer}


def register(name: str, fn: RewardFn) -> None:
    _REGISTRY[name] = fn


def get_reward_fn(name: str) -> RewardFn:
    if name not in _REGISTRY:
        raise UserError(f"config: reward function {name!r} is not registered; known: "
                        f"{', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]
