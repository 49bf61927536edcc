"""PPO's per-micro-batch losses on Megatron outputs, scaled so that any layout and micro-batch
split computes the exact aggregate of the whole mini-batch.

Megatron averages the loss over micro-batches and DDP averages gradients over data-parallel
ranks; ``batch["loss_weight"] = micro_batches * dp / global_denominator`` undoes both and
divides by the mini-batch's token count (token-mean) or sequence count (seq-mean-*).
"""

from __future__ import annotations

import torch

from megatron_rlhf.algorithms.advantages import masked_mean
from megatron_rlhf.algorithms.policy_losses import POLICY_LOSS_REGISTRY, clip_range
from megatron_rlhf.algorithms.ppo import (aggregate, aggregate_denominator, entropy_from_logits,
                                          kl_estimate, value_loss)
from megatron_rlhf.data.packing import grid_tensor, to_grid
from megatron_rlhf.distributed.layout import ParallelGroups
from megatron_rlhf.models.forward import gather_vocab_parallel, token_cross_entropy
from megatron_rlhf.models.output_head import OutputHead, token_logprobs_from_hidden


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                   groups: ParallelGroups, temperature: float = 1.0) -> torch.Tensor:
    """``log p(target)`` per position from vocab-parallel ``logits [b, t, V/tp]`` -> ``[b, t]``."""
    if temperature != 1.0:
        logits = logits / temperature
    return -token_cross_entropy(logits, targets, vocab_size, groups)


def grid_logprobs(logits: torch.Tensor, batch: dict, vocab_size: int, groups: ParallelGroups,
                  temperature: float = 1.0) -> torch.Tensor:
    """``log p(target)`` of a micro-batch's (possibly packed, pipeline-padded) ``logits`` on its
    sample grid ``[n, T]`` (see :func:`megatron_rlhf.data.packing.to_grid`)."""
    targets = batch["targets"][:logits.shape[0], :logits.shape[1]]
    return to_grid(token_logprobs(logits, targets, vocab_size, groups, temperature), batch)


def loss_positions_logprobs(hidden: torch.Tensor, batch: dict, head: OutputHead,
                            temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``log p(target)`` and entropy on the sample grid ``[n, T]`` from a micro-batch's last
    hidden states ``[b, t, h]``, computed only where ``loss_mask`` is set (0 elsewhere), in
    chunks of the output layer (:class:`megatron_rlhf.models.output_head.ChunkedTokenLogprobs`)."""
    mask = grid_tensor(batch, "loss_mask").bool()
    sample, position = mask.nonzero(as_tuple=True)
    grid = batch.get("grid")
    rows, cols = ((grid["unpack_row"][sample, position], grid["unpack_col"][sample, position])
                  if grid is not None else (sample, position))
    at = lambda t: t.to(hidden.device)  # noqa: E731
    logprob, entropy = token_logprobs_from_hidden(hidden[at(rows), at(cols)],
                                                  batch["targets"][rows, cols], head, temperature)
    index = (at(sample), at(position))
    zeros = torch.zeros(mask.shape, dtype=torch.float32, device=hidden.device)
    return zeros.index_put(index, logprob), zeros.index_put(index, entropy)


def token_entropy(logits: torch.Tensor, vocab_size: int, groups: ParallelGroups,
                  temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the (unpadded) vocabulary distribution per position -> ``[b, t]``."""
    full = gather_vocab_parallel(logits.float(), groups)[..., :vocab_size]
    return entropy_from_logits(full / temperature)


def actor_loss(logits: torch.Tensor, batch: dict, *, vocab_size: int, groups: ParallelGroups,
               cfg, kl_loss_coef: float, temperature: float, horizon: int,
               head: OutputHead | None = None):
    """PPO clipped surrogate, or GSPO's (+ entropy bonus, + KL loss) of one micro-batch; ``cfg``
    is the ``actor`` config section, ``horizon`` the response budget (``seq-mean-token-sum-norm``).
    Returns (scaled loss, metric sums). Per-token terms are computed on the model's (possibly
    packed) rows, then moved to the sample grid for the loss math. ``is_weights`` in the batch
    (rollout correction) weight each token's policy loss. With ``head``, ``logits`` are the last
    hidden states and only the loss positions are scored (:func:`loss_positions_logprobs`)."""
    take = lambda key: grid_tensor(batch, key).to(logits.device)  # noqa: E731
    mask = take("loss_mask")
    if head is not None:
        logprob, entropy = loss_positions_logprobs(logits, batch, head, temperature)
        if cfg.entropy_coeff <= 0:  # a metric only: its gradient term is skipped
            entropy = entropy.detach()
    else:
        logprob = grid_logprobs(logits, batch, vocab_size, groups, temperature)
        with torch.set_grad_enabled(cfg.entropy_coeff > 0 and torch.is_grad_enabled()):
            entropy = to_grid(token_entropy(logits, vocab_size, groups, temperature), batch)
    # Without stored old log-probs the update is on-policy (see reuses_update_log_probs).
    old = take("old_logprobs") if _has(batch, "old_logprobs") else logprob.detach()
    weights = take("is_weights") if _has(batch, "is_weights") else None
    agg = cfg.loss_agg_mode
    out = POLICY_LOSS_REGISTRY[cfg.policy_loss].compute(old, logprob, take("advantages"), mask, cfg,
                                                        clip_range(cfg), agg, weights, horizon)
    loss = out.loss
    if cfg.entropy_coeff > 0:
        loss = loss - cfg.entropy_coeff * aggregate(entropy, mask, agg, horizon)
    kl = (kl_estimate(logprob, take("ref_logprobs"), cfg.kl_loss_type) if _has(batch, "ref_logprobs")
          else torch.zeros_like(logprob))
    if cfg.use_kl_loss:
        loss = loss + kl_loss_coef * aggregate(kl, mask, agg, horizon)
    tokens, denominator = mask.sum(), aggregate_denominator(mask, agg, horizon)
    scale = denominator * batch["loss_weight"]
    # The loss is a mean over tokens or over sequences (loss_agg_mode): its sum is weighted by
    # that count, every per-token metric by the token count.
    metrics = {"pg_loss": out.loss.detach() * denominator, "loss_denominator": denominator,
               "clipfrac": out.clipfrac.detach() * tokens,
               "ppo_kl": out.approx_kl.detach() * tokens,
               "entropy": masked_mean(entropy.detach(), mask) * tokens,
               "kl": masked_mean(kl.detach(), mask) * tokens, "tokens": tokens,
               "count": torch.tensor(float(mask.shape[0]))}
    return loss * scale, metrics


def _has(batch: dict, key: str) -> bool:
    return key in batch.get("grid", batch)


def critic_loss(output: torch.Tensor, batch: dict, *, cliprange_value: float, agg_mode: str,
                horizon: int):
    """Clipped value loss of one micro-batch from the value head ``[b, t, 1]``."""
    take = lambda key: grid_tensor(batch, key).to(output.device)  # noqa: E731
    mask = take("loss_mask")
    values = to_grid(output[..., 0].float(), batch)
    loss, clipfrac = value_loss(values, take("values"), take("returns"), mask,
                                cliprange_value or None, agg_mode, horizon)
    tokens, denominator = mask.sum(), aggregate_denominator(mask, agg_mode, horizon)
    scale = denominator * batch["loss_weight"]
    metrics = {"vf_loss": loss.detach() * denominator, "loss_denominator": denominator,
               "vf_clipfrac": clipfrac.detach() * tokens,
               "tokens": tokens, "count": torch.tensor(float(mask.shape[0]))}
    return loss * scale, metrics
