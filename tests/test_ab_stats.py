"""A/B statistics on planted data: intervals cover what they should, tests detect a planted
difference, and the length control removes a planted length bias."""

import math

import numpy as np
import pytest

from megatron_rlhf.evaluation import ab_stats


def _outcomes(rng, prompts, k, p_win):
    """``[P, K]`` A-vs-B outcomes where A wins with probability ``p_win`` (no ties)."""
    return (rng.random((prompts, k)) < p_win).astype(float)


def test_identical_policies_interval_covers_one_half():
    # 100 seeds of A = B in distribution: the 95% interval should hold 0.5 about 95 times. The
    # seeds are fixed (numpy's PCG64 draws the same on every machine): 94 here; the bar is the
    # issue's 90.
    covered = 0
    for seed in range(100):
        rng = np.random.default_rng(seed)
        interval = ab_stats.bootstrap_interval(_outcomes(rng, 60, 2, 0.5), 500, seed)
        covered += interval.low <= 0.5 <= interval.high
    assert covered >= 90


def test_a_planted_60_40_preference_is_detected():
    rng = np.random.default_rng(7)
    a = rng.normal(size=(400, 2)) + (rng.random((400, 2)) < 0.6) * 2.0
    b = rng.normal(size=(400, 2)) + (rng.random((400, 2)) < 0.4) * 2.0
    summary = ab_stats.summarize(a, b, np.full((400, 2), 5), np.full((400, 2), 5),
                                 num_resamples=500, num_permutations=2000)
    assert summary["win_rate"]["low"] > 0.5 and summary["score_difference"]["low"] > 0
    assert summary["sign_test"]["p_value"] < 0.05 and summary["permutation_p_value"] < 0.05


def test_bootstrap_agrees_with_the_closed_form_on_many_prompts():
    rng = np.random.default_rng(3)
    values = _outcomes(rng, 5000, 1, 0.55)
    boot = ab_stats.bootstrap_interval(values, 2000, 0)
    normal = ab_stats.normal_interval(values)
    assert boot.estimate == pytest.approx(normal.estimate)
    assert boot.low == pytest.approx(normal.low, abs=0.004)
    assert boot.high == pytest.approx(normal.high, abs=0.004)
    w = values.mean()  # K = 1, 0/1 outcomes: the Wald interval
    assert normal.high - w == pytest.approx(1.959964 * math.sqrt(w * (1 - w) / 5000), rel=1e-4)


def test_intervals_resample_prompts_not_pairs():
    # K = 10 identical samples per prompt: the pairs carry no more information than the prompts.
    rng = np.random.default_rng(5)
    per_prompt = _outcomes(rng, 200, 1, 0.5)
    repeated = np.repeat(per_prompt, 10, axis=1)
    one, ten = (ab_stats.bootstrap_interval(v, 1000, 0) for v in (per_prompt, repeated))
    assert ten.high - ten.low == pytest.approx(one.high - one.low, rel=1e-9)


def test_exact_tests_by_hand():
    assert ab_stats.binomial_two_sided_p(0, 5) == pytest.approx(2 / 32)
    assert ab_stats.binomial_two_sided_p(1, 5) == pytest.approx(2 * 6 / 32)
    assert ab_stats.binomial_two_sided_p(3, 6) == 1.0 and ab_stats.binomial_two_sided_p(0, 0) == 1.0
    sign = ab_stats.sign_test(np.array([1.0, 1.0, 1.0, 0.5, 0.0]))
    assert (sign.wins, sign.losses, sign.ties) == (3, 1, 1)
    assert sign.p_value == pytest.approx(ab_stats.binomial_two_sided_p(3, 4))
    # All 2^3 sign patterns of [1, 2, 3]: |mean| >= 2 only for all-plus and all-minus.
    assert ab_stats.permutation_test(np.array([1.0, 2.0, 3.0])) == pytest.approx(2 / 8)


def test_length_control_removes_a_planted_length_bias():
    # The judge prefers the longer reply, whoever wrote it; A is longer more often.
    rng = np.random.default_rng(11)
    length_a = rng.integers(5, 30, size=(2000, 1)).astype(float)
    length_b = rng.integers(5, 20, size=(2000, 1)).astype(float)
    longer = 1.0 / (1.0 + np.exp(-(length_a - length_b) / 3.0))
    a = (rng.random((2000, 1)) < longer).astype(float)
    summary = ab_stats.summarize(a, 1 - a, length_a, length_b, num_resamples=200)
    # Raw: A "wins" 0.685 by length alone. Controlled: 0.539 (the tanh covariate does not match
    # the planted logistic in the raw difference exactly, so a little bias is left).
    assert summary["win_rate"]["estimate"] > 0.65
    assert abs(summary["length_controlled_win_rate"]["estimate"] - 0.5) < 0.05
    assert summary["length_slope"] > 0
