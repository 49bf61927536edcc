"""Reward functions the tests name as ``reward.fn=tests.reward_helpers:<function>``."""

import time

from megatron_rlhf.data.tasks import check_answer


def with_context(response, ground_truth, prompt, extra):
    """Four arguments and named extras."""
    return {"score": float(response == ground_truth), "prompt_chars": float(len(prompt)),
            "has_task": float("task" in extra)}


def length_in_tens(response, ground_truth):
    """A score that differs between the replies of an untrained tiny policy (which never
    answers right, so the checker's scores are all 0): group preferences that are not ties."""
    return len(response) / 10.0


def two_args(response, ground_truth):
    return 0.5


def three_args(response, ground_truth, prompt):
    return 0.0


def sleeps_or_raises(response, ground_truth):
    """By the response's text: "sleep" sleeps 30 s, "raise" raises, anything else scores 1."""
    if "sleep" in response:
        time.sleep(30)
    if "raise" in response:
        raise ValueError("asked to raise")
    return 1.0


def flaky(response, ground_truth):
    """The addition checker, except that a fifth of the responses (by their characters) hang
    and another fifth raise: a run with it must finish, counting and naming both."""
    bucket = sum(map(ord, response)) % 5
    if bucket == 0:
        time.sleep(60)
    if bucket == 1:
        raise RuntimeError("flaky reward")
    return check_answer(response, ground_truth)


def slow_addition(response, ground_truth):
    """The addition checker after 0.1 s: a run that only waits for a signal (a Slurm time
    limit) spends that wait mostly idle, not computing steps that no assertion reads."""
    time.sleep(0.1)
    return check_answer(response, ground_truth)
