"""A/B statistics: win rates, bootstrap intervals over prompts, paired tests, length control.

Pure NumPy (no torch, no torch.distributed), so every number here is testable on its own.

Shapes: ``P`` prompts, ``K`` samples per prompt. A *pair* is sample ``k`` of prompt ``p`` from
policy A and from policy B (same prompt, same sampling seed); ``[P, K]`` arrays hold one value
per pair, prompt-major.

Definitions (``s_A``, ``s_B`` the judge's scores of the two responses of a pair):

- outcome ``o[p, k] = 1`` if ``s_A > s_B``, ``1/2`` if equal, ``0`` if ``s_A < s_B``;
- win rate ``w = mean_{p,k} o[p, k]`` (ties count half), which equals ``mean_p ō[p]`` with
  ``ō[p] = mean_k o[p, k]`` because every prompt has ``K`` pairs;
- mean score difference ``d = mean_{p,k} (s_A - s_B)[p, k]``.

Intervals resample *prompts*, not pairs: the ``K`` samples of one prompt share the prompt (an
easy question is easy for both policies), so they move together. Drawing ``P`` prompt indices
with replacement and averaging their per-prompt means keeps that dependence; resampling the
``P * K`` pairs as if independent would understate the variance by the design effect
``1 + (K - 1) * ICC`` (intra-prompt correlation ``ICC``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist

import numpy as np

LEVEL = 0.95
_BLOCK = 4_000_000  # resample indices held at once (R x P entries), bounding memory


@dataclass(frozen=True)
class Interval:
    """A point estimate and its ``level`` two-sided interval ``[low, high]``."""

    estimate: float
    low: float
    high: float

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SignTest:
    """Exact two-sided sign test over prompts (``ties`` prompts dropped)."""

    wins: int
    losses: int
    ties: int
    p_value: float


def pair_outcomes(scores_a: np.ndarray, scores_b: np.ndarray) -> np.ndarray:
    """``[P, K]`` scores -> ``[P, K]`` outcomes in {1, 0.5, 0} (A wins, tie, A loses)."""
    a, b = np.asarray(scores_a, float), np.asarray(scores_b, float)
    return np.where(a > b, 1.0, np.where(a < b, 0.0, 0.5))


def prompt_means(values: np.ndarray) -> np.ndarray:
    """``[P, K]`` (or ``[P]``, read as ``K = 1``) -> per-prompt means ``[P]``."""
    values = np.asarray(values, float)
    return values.reshape(values.shape[0], -1).mean(axis=1)


def resample_indices(num_prompts: int, num_resamples: int, rng: np.random.Generator):
    """Yield blocks ``[r, P]`` of prompt indices drawn with replacement, ``num_resamples`` rows in
    all; the same ``rng`` gives the same rows, so statistics sharing it see the same resamples."""
    rows = max(1, _BLOCK // max(1, num_prompts))
    for start in range(0, num_resamples, rows):
        yield rng.integers(0, num_prompts, size=(min(rows, num_resamples - start), num_prompts))


def bootstrap_means(values: np.ndarray, num_resamples: int, seed: int) -> np.ndarray:
    """Bootstrap distribution ``[R]`` of the mean of ``values [P, K]``, resampling prompts:
    ``mean_{i=1..P} ō[p_i]`` with ``p_i`` uniform over the ``P`` prompts, for each of ``R`` draws."""
    means = prompt_means(values)
    rng = np.random.default_rng(seed)
    return np.concatenate([means[block].mean(axis=1)
                           for block in resample_indices(len(means), num_resamples, rng)])


def percentile_interval(draws: np.ndarray, estimate: float, level: float = LEVEL) -> Interval:
    """Percentile bootstrap interval: the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles."""
    low, high = np.quantile(np.asarray(draws, float), [(1 - level) / 2, (1 + level) / 2])
    return Interval(float(estimate), float(low), float(high))


def bootstrap_interval(values: np.ndarray, num_resamples: int = 2000, seed: int = 0,
                       level: float = LEVEL) -> Interval:
    """Mean of ``values [P, K]`` with its percentile bootstrap interval over prompts."""
    estimate = float(prompt_means(values).mean())
    return percentile_interval(bootstrap_means(values, num_resamples, seed), estimate, level)


def normal_interval(values: np.ndarray, level: float = LEVEL) -> Interval:
    """Closed-form interval over prompts: ``m ± z * sd(ō) / sqrt(P)`` with ``m = mean_p ō[p]``,
    ``sd`` the population (ddof 0) standard deviation of the per-prompt means and ``z`` the normal
    quantile. For ``K = 1`` and 0/1 outcomes this is the Wald interval ``w ± z sqrt(w(1-w)/n)``."""
    means = prompt_means(values)
    z = NormalDist().inv_cdf((1 + level) / 2)
    half = z * float(means.std()) / math.sqrt(len(means))
    estimate = float(means.mean())
    return Interval(estimate, estimate - half, estimate + half)


def binomial_two_sided_p(successes: int, trials: int) -> float:
    """Exact two-sided p-value of ``successes`` out of ``trials`` under Binomial(n, 1/2):
    ``min(1, 2 * min(P[X <= k], P[X >= k]))`` (for p = 1/2 equal to summing all outcomes no more
    likely than ``k``). Computed in log space, exact enough for any ``n``."""
    if trials == 0:
        return 1.0
    k = min(successes, trials - successes)
    logs = [math.lgamma(trials + 1) - math.lgamma(i + 1) - math.lgamma(trials - i + 1)
            - trials * math.log(2) for i in range(k + 1)]
    top = max(logs)
    tail = math.exp(top) * sum(math.exp(v - top) for v in logs)
    return min(1.0, 2.0 * tail)


def sign_test(prompt_outcomes: np.ndarray) -> SignTest:
    """Sign test on per-prompt mean outcomes ``ō [P]``: a prompt is a win for A when ``ō > 1/2``,
    a loss when ``ō < 1/2`` and dropped when ``ō = 1/2``; H0: wins ~ Binomial(wins + losses, 1/2).
    Prompts, not pairs, are the independent units."""
    means = np.asarray(prompt_outcomes, float)
    wins, losses = int((means > 0.5).sum()), int((means < 0.5).sum())
    return SignTest(wins, losses, len(means) - wins - losses,
                    binomial_two_sided_p(wins, wins + losses))


def permutation_test(prompt_differences: np.ndarray, num_permutations: int = 10000,
                     seed: int = 0) -> float:
    """Paired permutation (sign-flip) test of H0 "A and B are exchangeable within a prompt".

    Under H0 swapping the A and B labels of all ``K`` pairs of a prompt flips the sign of its mean
    difference ``d̄[p]``. Statistic ``T = |mean_p d̄[p]|``; with ``P <= 12`` all ``2^P`` sign
    patterns are enumerated (exact), otherwise ``num_permutations`` random ones give
    ``p = (1 + #{T* >= T}) / (1 + R)``.
    """
    diffs = np.asarray(prompt_differences, float)
    count = len(diffs)
    observed = abs(diffs.mean()) - 1e-12 * max(1.0, float(np.abs(diffs).max(initial=0.0)))
    if count <= 12:
        patterns = (np.arange(2 ** count)[:, None] >> np.arange(count)) & 1
        stats = np.abs(((2 * patterns - 1) * diffs).mean(axis=1))
        return float((stats >= observed).mean())
    rng = np.random.default_rng(seed)
    rows, extreme = max(1, _BLOCK // count), 0
    for start in range(0, num_permutations, rows):
        signs = rng.choice((-1.0, 1.0), size=(min(rows, num_permutations - start), count))
        extreme += int((np.abs((signs * diffs).mean(axis=1)) >= observed).sum())
    return (1 + extreme) / (1 + num_permutations)


def length_covariate(length_differences: np.ndarray) -> np.ndarray:
    """``tanh(Δ / sd(Δ))`` of the length differences ``Δ = len_A - len_B`` (any shape): zero at
    equal lengths, bounded so a few very long replies cannot dominate the fit (as AlpacaEval 2's
    length-controlled win rate); all zeros when every difference is equal."""
    delta = np.asarray(length_differences, float)
    scale = float(delta.std())
    return np.tanh(delta / scale) if scale > 0 else np.zeros_like(delta)


def fit_logistic(x: np.ndarray, y: np.ndarray, iterations: int = 100) -> tuple[float, float]:
    """Maximum-likelihood ``(b0, b1)`` of ``P[win] = sigmoid(b0 + b1 x)`` for outcomes ``y`` in
    [0, 1] (ties are ``y = 1/2``: a fractional response, quasi-likelihood), by Newton's method.
    ``x``, ``y``: ``[N]``. When ``x`` is constant the slope is 0 and ``b0 = logit(mean y)``; under
    separation (all wins) ``b0`` grows until the iteration cap, i.e. ``sigmoid(b0) -> 1``."""
    x, y = np.asarray(x, float).ravel(), np.asarray(y, float).ravel()
    design = np.stack([np.ones_like(x), x], axis=1) if np.ptp(x) > 0 else np.ones((len(x), 1))
    beta = np.zeros(design.shape[1])
    for _ in range(iterations):
        prob = 1.0 / (1.0 + np.exp(-np.clip(design @ beta, -30, 30)))
        weight = prob * (1 - prob) + 1e-12
        hessian = design.T @ (design * weight[:, None]) + 1e-9 * np.eye(design.shape[1])
        step = np.linalg.solve(hessian, design.T @ (y - prob))
        beta += step
        if np.abs(step).max() < 1e-10:
            break
    return float(beta[0]), float(beta[1]) if len(beta) > 1 else 0.0


def length_controlled_win_rate(outcomes: np.ndarray, covariate: np.ndarray) -> tuple[float, float]:
    """``(sigmoid(b0), b1)``: the fitted win rate at equal lengths (covariate 0) and the change in
    log-odds of a win per unit of the covariate (see :func:`length_covariate`). Outcomes that are
    all equal (all ties, all wins) are their own answer at any length."""
    outcomes = np.asarray(outcomes, float)
    if np.ptp(outcomes) == 0:
        return float(outcomes.flat[0]), 0.0
    b0, b1 = fit_logistic(covariate, outcomes)
    return 1.0 / (1.0 + math.exp(-b0)), b1


def _bootstrap_length_control(outcomes: np.ndarray, covariate: np.ndarray, num_resamples: int,
                              seed: int) -> np.ndarray:
    """Length-controlled win rates ``[R]`` refitted on prompt resamples (``[P, K]`` inputs)."""
    rng, draws = np.random.default_rng(seed), []
    for block in resample_indices(outcomes.shape[0], num_resamples, rng):
        draws += [length_controlled_win_rate(outcomes[rows], covariate[rows])[0] for rows in block]
    return np.asarray(draws)


def summarize(scores_a: np.ndarray, scores_b: np.ndarray, length_a: np.ndarray,
              length_b: np.ndarray, num_resamples: int = 2000, seed: int = 0,
              level: float = LEVEL, num_permutations: int = 10000) -> dict:
    """Everything the report shows, from ``[P, K]`` scores and response lengths.

    Every bootstrap statistic uses the same ``seed``, hence the same prompt resamples.
    """
    a, b = np.asarray(scores_a, float), np.asarray(scores_b, float)
    outcomes, diffs = pair_outcomes(a, b), a - b
    covariate = length_covariate(np.asarray(length_a, float) - np.asarray(length_b, float))
    rate, slope = length_controlled_win_rate(outcomes, covariate)
    lc_draws = _bootstrap_length_control(outcomes, covariate, num_resamples, seed)
    return {
        "num_prompts": int(a.shape[0]), "samples_per_prompt": int(a.shape[1]),
        "num_pairs": int(a.size), "level": level, "num_resamples": num_resamples,
        "win": float((outcomes == 1).mean()), "tie": float((outcomes == 0.5).mean()),
        "loss": float((outcomes == 0).mean()),
        "win_rate": bootstrap_interval(outcomes, num_resamples, seed, level).as_dict(),
        "win_rate_normal": normal_interval(outcomes, level).as_dict(),
        "mean_score_a": float(a.mean()), "mean_score_b": float(b.mean()),
        "score_difference": bootstrap_interval(diffs, num_resamples, seed, level).as_dict(),
        "sign_test": asdict(sign_test(prompt_means(outcomes))),
        "permutation_p_value": permutation_test(prompt_means(diffs), num_permutations, seed),
        "length_controlled_win_rate": percentile_interval(lc_draws, rate, level).as_dict(),
        "length_slope": slope,
    }
