"""Verifiable rewards: names resolve (built-ins, reasoning-gym tasks, module:function), the
built-ins score known answers, and the pool's timeout and error accounting keep a run going."""

import pytest

from megatron_rlhf.errors import UserError
from megatron_rlhf.rewards.registry import as_score, resolve
from megatron_rlhf.rewards.scorer import RewardScorer


def test_names_resolve_with_their_signature():
    assert resolve("addition").takes_context is False
    fn = resolve("tests.reward_helpers:with_context")
    assert fn.takes_context and fn.score("7", "7", "what?", {"task": "x"}) == (
        1.0, {"prompt_chars": 5.0, "has_task": 1.0})
    assert resolve("tests.reward_helpers:two_args").score("a", "b") == (0.5, {})


@pytest.mark.parametrize("spec, message", [
    ("nope", "is not a built-in reward"),
    ("tests.no_such_module:f", "cannot import module 'tests.no_such_module'"),
    ("tests.reward_helpers:missing", "has no attribute 'missing'"),
    ("tests.reward_helpers:three_args", "takes (response, ground_truth, prompt)"),
    ("reasoning_gym:no_such_task", "reasoning-gym has no task 'no_such_task'"),
])
def test_bad_names_are_one_line_naming_the_key(spec, message):
    with pytest.raises(UserError, match=r"config: reward.oracle_fn=.*" + message.replace("(", r"\(")
                       .replace(")", r"\)")):
        resolve(spec, "reward.oracle_fn")


def test_return_values_must_be_scores():
    assert as_score(True) == (1.0, {})
    assert as_score({"score": 0.25, "n": 2}) == (0.25, {"n": 2.0})
    for bad, error in (("1.0", TypeError), ({"n": 1}, TypeError), (float("nan"), ValueError),
                       ({"score": 1, "label": "x"}, TypeError)):
        with pytest.raises(error):
            as_score(bad)


def test_math_reward_extracts_and_compares():
    math = resolve("math")
    assert math.score("so \\boxed{\\frac{1}{2}}.", "0.5") == (1.0, {"answer_found": 1.0})
    assert math.score("The total is 1,000 apples", "1000")[0] == 1.0
    assert math.score("first 3 then 4", "3")[0] == 0.0  # the last number is the answer
    assert math.score("\\boxed{x+1}", "1+x")[0] == 1.0  # symbolic, via math-verify
    assert math.score("no idea", "3") == (0.0, {"answer_found": 0.0})


def test_math_reward_without_math_verify_is_refused_not_weakened(monkeypatch):
    """Without math-verify, reward.fn=math would be string equality: refused in one line naming
    the key and the [tasks] extra, at resolve time (start-up), and never scored quietly."""
    from megatron_rlhf.errors import UserError
    from megatron_rlhf.rewards import verifiable

    monkeypatch.setattr(verifiable, "_math_verify", lambda: None)
    with pytest.raises(UserError, match=r"reward.fn=math needs the math-verify.*\[tasks\]"):
        resolve("math")
    with pytest.raises(UserError, match=r"critic_fn=math needs"):
        resolve("math", "critic_fn")
    with pytest.raises(UserError, match="math-verify"):
        verifiable.math_equal("\\frac{1}{2}", "0.5")


def test_format_reward_matches_the_whole_response():
    fmt = resolve("format")
    assert fmt.score("<think>a\nb</think> <answer>4</answer>", "")[0] == 1.0
    assert fmt.score("<answer>4</answer>", "")[0] == 0.0
    assert fmt.score("<think>a</think><answer>4</answer> trailing", "")[0] == 0.0


def test_reasoning_gym_tasks_use_their_own_scorer():
    import json

    import reasoning_gym

    for task in ("basic_arithmetic", "chain_sum", "gsm_symbolic"):
        entry = reasoning_gym.create_dataset(task, size=1, seed=3)[0]
        fn = resolve(f"reasoning_gym:{task}")
        extra = {"metadata": json.dumps(entry["metadata"], default=str)}
        right = fn.score(f"<answer>{entry['answer']}</answer>", entry["answer"],
                         entry["question"], extra)
        assert right == (1.0, {"answer_tagged": 1.0}), task
        wrong = fn.score("<answer>-987654</answer>", entry["answer"], entry["question"], extra)
        assert wrong[0] < 1.0, task
        untagged = fn.score(f"The answer is {entry['answer']}", entry["answer"],
                            entry["question"], extra)
        assert untagged[1] == {"answer_tagged": 0.0}, task


def test_pool_counts_timeouts_and_errors_and_keeps_going():
    calls = [("fine", "t", "", {}), ("please sleep", "t", "", {}), ("raise now", "t", "", {}),
             ("fine again", "t", "", {})]
    with RewardScorer.from_specs("tests.reward_helpers:sleeps_or_raises", None, workers=2,
                                 timeout_s=1.0) as scorer:
        assert scorer.score("fn", calls) == [1.0, 0.0, 0.0, 1.0]
        metrics, lines = scorer.drain()
        assert metrics["reward/timeouts"] == 1.0 and metrics["reward/errors"] == 1.0
        assert any("'tests.reward_helpers:sleeps_or_raises' timed out" in line for line in lines)
        assert any("raised ValueError on 1 of 4 call(s)" in line and "asked to raise" in line
                   for line in lines)
        assert scorer.pool.restarts == 1  # the hung worker was replaced...
        assert scorer.score("fn", calls[:1]) == [1.0]  # ...and the pool still scores
        assert scorer.drain()[0]["reward/timeouts"] == 0.0


def test_in_process_scoring_counts_errors_too():
    scorer = RewardScorer.from_specs("tests.reward_helpers:sleeps_or_raises", None, workers=0)
    assert scorer.score("fn", [("raise", "t", "", {}), ("ok", "t", "", {})]) == [0.0, 1.0]
    assert scorer.drain()[0]["reward/errors"] == 1.0


def test_ground_truth_is_required_only_where_a_built_in_reads_it():
    assert RewardScorer.from_specs("addition", None).needs_ground_truth()
    assert RewardScorer.from_specs("math", None).needs_ground_truth()
    assert not RewardScorer.from_specs("format", None).needs_ground_truth()
    assert not RewardScorer.from_specs("tests.reward_helpers:two_args", None).needs_ground_truth()
    with pytest.raises(ValueError):
        RewardScorer.from_specs("addition", None).check_ground_truth("seven")
