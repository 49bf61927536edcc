"""Correcting for the gap between the rollout engine's sampling probabilities and the trainer's.

The engine samples from ``pi_rollout`` (another kernel, bf16, a quantised model, a stale copy);
the update's importance ratio is taken against the trainer's ``pi_old``. verl 0.9.1's toolbox
(``verl/trainer/ppo/rollout_corr_helper.py``, its names kept), on detached log-probs of the
sampled tokens: pure tensor code, ``[B, T]`` with ``mask``, ``r = pi_old / pi_rollout`` per token.

* Importance weights (:func:`tis_weights`): ``r`` per token (``token``), the product over the
  sequence (``sequence``) or its geometric mean (``geometric``, which does not shrink with length;
  verl 0.9.1 has it only as a rejection statistic), truncated at a cap (TIS; Yao et al. 2025,
  "Your efficient RL framework secretly brings you off-policy RL training") or, IcePop's
  two-sided band, set to zero outside ``[low, high]``; optionally divided by their batch mean.
* Rejection sampling (:func:`rejection_keep`): tokens (``token_k*``) or whole samples
  (``seq_sum_k*``, ``seq_mean_k*``, ``seq_max_k*``) whose divergence leaves its bound are left
  out of the loss. Per token ``k1 = log r`` (bounded on both sides, as a ratio band),
  ``k2 = (log r)^2 / 2``, ``k3 = r - 1 - log r`` (bounded above).
* Diagnostics (:func:`mismatch_metrics`, :func:`is_metrics`), and :func:`correct`, which applies
  a configuration to one batch.

Sign convention: verl's ``*_k1`` statistic is ``-log r`` and its bounds apply to
``pi_rollout / pi_old``; ours bound ``r`` itself, so our ``[low, high]`` is verl's
``"1/high_1/low"`` (the same band for the symmetric 0.5 and 2). As verl, log-ratios are clamped
to +-20 before they are exponentiated (a sequence's sum after summing, for its weight) and per
token before a rejection statistic sums them. Masked positions count as 0 whatever they hold: an
inf or NaN log-prob on padding must not poison a sum (verl's token weights turn NaN there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

SAFETY_BOUND = 20.0  # exp(20) ~ 4.9e8: no weight or statistic overflows on its way to a cap
TIS_LEVELS = ("token", "sequence", "geometric")
REJECTION_OPTIONS = ("token_k1", "token_k2", "token_k3",
                     "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                     "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
                     "seq_max_k2", "seq_max_k3")  # verl 0.9.1's; a max of signed k1 bounds nothing
MASK_ALIASES = {"geometric": "seq_mean_k1", "sequence": "seq_sum_k1"}  # the first two we had
MASK_LEVELS = (*MASK_ALIASES, *REJECTION_OPTIONS)


def log_ratio(old_logprob: torch.Tensor, rollout_logprob: torch.Tensor,
              mask: torch.Tensor) -> torch.Tensor:
    """``log(pi_old / pi_rollout)`` per token, detached, 0 off the mask (not multiplied by 0: an
    inf there would give NaN): ``[B, T]``, unclamped."""
    gap = (old_logprob - rollout_logprob).detach()
    return torch.where(mask.bool(), gap, torch.zeros((), dtype=gap.dtype, device=gap.device))


def _tokens(mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Valid tokens of ``mask`` (per row with ``dim=1``), at least 1: a mean's denominator."""
    return (mask.sum() if dim is None else mask.sum(dim=dim)).clamp(min=1.0)


def raw_is_weights(old_logprob: torch.Tensor, rollout_logprob: torch.Tensor, mask: torch.Tensor,
                   level: str = "token") -> torch.Tensor:
    """Importance weights before truncation, 0 off the mask: ``[B, T]``. ``token``:
    ``exp(clamp(log r_t))``; ``sequence``: ``exp(clamp(sum_t log r_t))`` on every token of the
    sequence; ``geometric``: ``exp(clamp(mean_t log r_t))`` likewise (sums over the mask)."""
    lr = log_ratio(old_logprob, rollout_logprob, mask)
    if level == "token":
        log_weight = lr
    elif level in ("sequence", "geometric"):
        log_weight = lr.sum(dim=1, keepdim=True)
        if level == "geometric":
            log_weight = log_weight / _tokens(mask, 1)[:, None]
    else:
        raise ValueError(f"unknown TIS level {level!r}; choose from {TIS_LEVELS}")
    return torch.exp(log_weight.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * mask.to(lr.dtype)


def tis_weights(old_logprob: torch.Tensor, rollout_logprob: torch.Tensor, mask: torch.Tensor,
                cap: float, level: str = "token", low: float = 0.0,
                batch_normalize: bool = False) -> torch.Tensor:
    """Importance weights, 0 off the mask, no gradient: ``[B, T]``. The raw weights of ``level``
    (:func:`raw_is_weights`) capped at ``cap`` (TIS: verl's ``rollout_is_threshold=cap``), or,
    with ``low > 0``, set to zero outside ``[low, cap]`` (IcePop: verl's
    ``rollout_is_threshold="low_cap"``); then, with ``batch_normalize``, divided by their mean
    (:func:`normalize_is_weights`, verl's ``rollout_is_batch_normalize``)."""
    weights = bound_weights(raw_is_weights(old_logprob, rollout_logprob, mask, level), cap, low)
    if batch_normalize:
        weights = normalize_is_weights(weights, mask, level)[0]
    return weights


def bound_weights(raw: torch.Tensor, cap: float, low: float = 0.0) -> torch.Tensor:
    """Raw weights ``[B, T]`` capped at ``cap`` (TIS), or with ``low > 0`` zeroed outside
    ``[low, cap]`` (IcePop)."""
    if low > 0:
        return torch.where((raw >= low) & (raw <= cap), raw, torch.zeros_like(raw))
    return raw.clamp(max=cap)


def normalize_is_weights(weights: torch.Tensor, mask: torch.Tensor,
                         level: str = "token") -> tuple[torch.Tensor, float]:
    """Weights ``[B, T]`` divided by their mean: over the batch's valid tokens (``token``), or
    over its non-empty sequences, one weight each (``sequence``, ``geometric``). Returns (weights,
    the mean divided by); a mean of 1e-8 or less leaves them as they are (factor 1), as verl."""
    m = mask.to(weights.dtype)
    if level == "token":
        mean = (weights * m).sum() / _tokens(m)
    else:
        rows = m.sum(dim=1) > 0
        per_row = (weights * m).sum(dim=1) / _tokens(m, 1)  # the sequence's weight
        mean = per_row[rows].sum() / rows.sum().clamp(min=1)
    if not mean > 1e-8:
        return weights, 1.0
    return weights / mean, float(mean)


def divergence(lr: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token statistic of the log-ratio ``lr = log r`` (clamped to +-20 first): ``k1 = log r``
    (verl's is ``-log r``), ``k2 = (log r)^2 / 2``, ``k3 = r - 1 - log r``. ``[B, T] -> [B, T]``."""
    c = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    if kind == "k1":
        return c
    if kind == "k2":
        return 0.5 * c ** 2
    if kind == "k3":
        return torch.exp(c) - 1.0 - c
    raise ValueError(f"unknown divergence {kind!r}; choose from k1, k2, k3")


def rejection_statistic(old_logprob: torch.Tensor, rollout_logprob: torch.Tensor,
                        mask: torch.Tensor, option: str) -> torch.Tensor:
    """What ``option`` (:data:`REJECTION_OPTIONS` or an alias) bounds: the per-token divergence
    ``[B, T]`` (``token_*``), or per sequence ``[B]`` its sum, mean or max over the valid tokens
    (``seq_sum_*``, ``seq_mean_*``, ``seq_max_*``; 0 for an empty response)."""
    option = MASK_ALIASES.get(option, option)
    if option not in REJECTION_OPTIONS:
        raise ValueError(f"unknown rejection option {option!r}; choose from {MASK_LEVELS}")
    scope, kind = option.rsplit("_", 1)
    per_token = divergence(log_ratio(old_logprob, rollout_logprob, mask), kind)
    valid = mask.bool()
    per_token = torch.where(valid, per_token, torch.zeros_like(per_token))
    if scope == "token":
        return per_token
    if scope == "seq_sum":
        return per_token.sum(dim=1)
    if scope == "seq_mean":
        return per_token.sum(dim=1) / _tokens(mask.to(per_token.dtype), 1)
    largest = per_token.masked_fill(~valid, -math.inf).max(dim=1).values
    return torch.where(valid.any(dim=1), largest, torch.zeros_like(largest))


def rejection_keep(old_logprob: torch.Tensor, rollout_logprob: torch.Tensor, mask: torch.Tensor,
                   option: str, low: float = 0.5, high: float = 2.0,
                   threshold: float = 0.01) -> torch.Tensor:
    """Tokens the rejection ``option`` keeps: ``[B, T]`` bool, one value per row for ``seq_*``
    (``mask * keep`` is verl's rejected response mask). ``*_k1``: the ratio ``r`` (its product or
    geometric mean for ``seq_sum``/``seq_mean``) in ``[low, high]``; ``k2``/``k3``: the statistic
    at most ``threshold`` (nats). An empty response's statistic is 0 (ratio 1)."""
    stat = rejection_statistic(old_logprob, rollout_logprob, mask, option)
    if MASK_ALIASES.get(option, option).endswith("k1"):
        keep = (stat >= math.log(low)) & (stat <= math.log(high))
    else:
        keep = stat <= threshold
    return keep if keep.dim() == 2 else keep[:, None].expand(mask.shape)


def sequence_keep(old_logprob: torch.Tensor, rollout_logprob: torch.Tensor, mask: torch.Tensor,
                  low: float, high: float, level: str = "geometric") -> torch.Tensor:
    """Which samples' importance ratio ``pi_old / pi_rollout`` lies in ``[low, high]``: the
    product over tokens (``sequence``: ``seq_sum_k1``) or its geometric mean (``geometric``:
    ``seq_mean_k1``). ``[B, T] -> [B]`` bool; an empty response is kept when 1 is in the band."""
    if level not in MASK_ALIASES:
        raise ValueError(f"unknown mask level {level!r}; choose from {tuple(MASK_ALIASES)}")
    return rejection_keep(old_logprob, rollout_logprob, mask, level, low, high).all(dim=1)


def is_token_level(option: str) -> bool:
    """Whether a rejection option (or alias) masks single tokens rather than whole samples."""
    return MASK_ALIASES.get(option, option).startswith("token_")


def mismatch(old_logprob: torch.Tensor, rollout_logprob: torch.Tensor,
             mask: torch.Tensor) -> dict[str, float]:
    """How far the engine's log-probs are from the trainer's over the response tokens: the mean
    and max of ``|log r|`` (``rollout/*``, the names runs have always logged)."""
    gap = log_ratio(old_logprob, rollout_logprob, mask).abs()
    return {"rollout/logprob_diff_mean": float(gap.sum() / _tokens(mask)),
            "rollout/logprob_diff_max": float(gap.max()) if gap.numel() else 0.0}


def mismatch_metrics(old_logprob: torch.Tensor, rollout_logprob: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, float]:
    """verl's off-policy diagnostics (``compute_offpolicy_metrics``) over ``[B, T]``:
    ``mismatch/kl_k1``: mean over tokens of ``log pi_rollout - log pi_old`` (an estimate of
    KL(pi_rollout || pi_old)); ``mismatch/kl_k3``: of ``r - 1 - log r``; ``mismatch/ppl_ratio``:
    mean over non-empty sequences of the trainer's perplexity over the engine's,
    ``exp(-mean_t log r)``; ``mismatch/logprob_diff_mean``: mean over tokens of ``|log r|``."""
    lr = log_ratio(old_logprob, rollout_logprob, mask)
    m = mask.to(lr.dtype)
    tokens, per_row = m.sum(dim=1), _tokens(m, 1)
    rows = tokens > 0
    log_ppl_diff = (-lr.sum(dim=1) / per_row).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {"mismatch/kl_k1": float(-lr.sum() / _tokens(m)),
            "mismatch/kl_k3": float((divergence(lr, "k3") * m).sum() / _tokens(m)),
            "mismatch/ppl_ratio": float(torch.exp(log_ppl_diff)[rows].sum() / rows.sum().clamp(min=1)),
            "mismatch/logprob_diff_mean": float(lr.abs().sum() / _tokens(m))}


def is_metrics(raw: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor, cap: float,
               low: float = 0.0) -> dict[str, float]:
    """Importance-weight diagnostics over the valid tokens, from the raw weights ``[B, T]`` and
    the applied ones before any batch normalisation: ``is/weight_mean``, ``is/weight_max``;
    ``is/capped_fraction``: tokens whose raw weight exceeded ``cap`` (TIS; 0 under IcePop);
    ``is/zeroed_fraction``: tokens IcePop zeroed, raw weight outside ``[low, cap]`` (0 under TIS)."""
    valid = mask.bool()
    m, tokens = mask.to(raw.dtype), _tokens(mask.to(raw.dtype))
    outside = ((raw < low) | (raw > cap)) if low > 0 else torch.zeros_like(valid)
    capped = (raw > cap) if low <= 0 else torch.zeros_like(valid)
    largest = weights.masked_fill(~valid, -math.inf).max() if bool(valid.any()) else torch.zeros(())
    return {"is/weight_mean": float((weights * m).sum() / tokens),
            "is/weight_max": float(largest),
            "is/capped_fraction": float((capped & valid).sum() / tokens),
            "is/zeroed_fraction": float((outside & valid).sum() / tokens)}


@dataclass
class Correction:
    """What :func:`correct` decided for one batch ``[B, T]``."""

    weights: torch.Tensor | None = None  # [B, T] importance weights (mode tis), else None
    rows: torch.Tensor | None = None  # [B] bool: samples a sequence-level rejection keeps
    tokens: torch.Tensor | None = None  # [B, T] bool: tokens a token-level rejection keeps
    metrics: dict[str, float] = field(default_factory=dict)


def correct(old_logprob: torch.Tensor, rollout_logprob: torch.Tensor, mask: torch.Tensor,
            settings) -> Correction:
    """Apply ``settings`` (any object with ``algorithm.rollout_correction``'s fields: ``mode``
    ``tis``/``mask``/``tis+mask``, ``tis_*``, ``mask_*``) to one batch of log-probs ``[B, T]``.
    Metrics: ``mismatch/*`` always; with IS ``is/*`` and ``rollout/is_weight_mean``,
    ``rollout/is_capped_fraction`` (weights at the cap), all before any batch normalisation;
    ``rs/rejected_fraction`` (tokens) and, for a sequence-level rejection,
    ``rollout/masked_fraction`` (samples)."""
    s = settings
    out = Correction(metrics=mismatch(old_logprob, rollout_logprob, mask)
                     | mismatch_metrics(old_logprob, rollout_logprob, mask))
    tokens = _tokens(mask)
    if "tis" in s.mode:
        raw = raw_is_weights(old_logprob, rollout_logprob, mask, s.tis_level)
        weights = bound_weights(raw, s.tis_cap, s.tis_low)
        out.metrics |= is_metrics(raw, weights, mask, s.tis_cap, s.tis_low)
        out.metrics["rollout/is_weight_mean"] = float(weights.sum() / tokens)
        out.metrics["rollout/is_capped_fraction"] = float(((weights >= s.tis_cap) * mask).sum() / tokens)
        if s.tis_batch_normalize:  # after the metrics: they describe the weights, not the scale
            weights, factor = normalize_is_weights(weights, mask, s.tis_level)
            out.metrics["is/batch_norm_factor"] = factor
        out.weights = weights
    if "mask" in s.mode:
        keep = rejection_keep(old_logprob, rollout_logprob, mask, s.mask_level, s.mask_low,
                              s.mask_high, s.mask_divergence_max)
        out.metrics["rs/rejected_fraction"] = float(((~keep) * mask).sum() / tokens)
        if is_token_level(s.mask_level):
            out.tokens = keep
        else:
            out.rows = keep.all(dim=1)
            out.metrics["rollout/masked_fraction"] = float(1.0 - out.rows.float().mean())
    return out
