"""Running micro-batches through a (possibly pipelined) Megatron model: the schedule, forward-only
passes with a head on the last stage, and vocab-parallel gathers."""

from __future__ import annotations

from typing import Any, Callable

import torch

from megatron_rlhf.distributed.layout import ParallelGroups
from megatron_rlhf.data.packing import pad_to_common_shape
from megatron_rlhf.distributed.platform import device
from megatron_rlhf.models.output_head import hidden_states_out


def pad_right(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists into ``input_ids [B, T]`` and ``lengths [B]``.

    Right padding never changes a causal model's outputs at real positions, so no mask is needed.
    """
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
    tokens = torch.full((len(sequences), int(lengths.max())), pad_id, dtype=torch.long)
    for row, seq in enumerate(sequences):
        tokens[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return tokens, lengths


def _config(model):
    return getattr(model, "config", None) or model.module.config


def sequence_multiple(model) -> int:
    """Sequence parallelism splits the sequence over TP ranks: lengths must divide by TP."""
    config = _config(model)
    return config.tensor_model_parallel_size if config.sequence_parallel else 1


def _pad_sequence(tokens: torch.Tensor, mask: torch.Tensor | None, extra: int):
    """Right-pad ``extra`` positions. They see only themselves (a row with no visible key would
    softmax to NaN, and NaN times a zero gradient is still NaN); real positions never see them."""
    tokens = torch.nn.functional.pad(tokens, (0, extra))
    if mask is not None:
        length = mask.shape[-1]
        mask = torch.nn.functional.pad(mask, (0, extra, 0, extra), value=True)
        own = torch.arange(length, length + extra, device=mask.device)
        mask[..., own, own] = False
    return tokens, mask


def _rotary_modules(model) -> list:
    """``model``'s RoPE modules (megatron's ``RotaryEmbedding`` and its YaRN subclass: one in a
    GPT model's pre-processing, one in each multi-latent attention layer), each hooked once
    (whichever wrapper found it first) to turn its frequencies for positions ``0..S-1`` into
    those of the positions set on it (:func:`_per_token_rope`)."""
    found = model.__dict__.get("_rlhf_rotary")
    if found is None:
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        found = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
        for module in found:
            if "_rlhf_positions" not in module.__dict__:
                module._rlhf_positions = None
                module.register_forward_hook(_per_token_rope)
        model.__dict__["_rlhf_rotary"] = found
    return found


def _per_token_rope(module, args, output):
    """Frequencies ``[S, 1, 1, d]`` (one row a position, every batch row alike) -> ``[s, b, 1, d]``
    at ``module._rlhf_positions [b, s]``: a shared prompt's replies each continue from the
    prompt's end. Megatron's unfused RoPE broadcasts either shape; YaRN's (freqs, mscale)
    keeps its mscale."""
    positions = module._rlhf_positions
    if positions is None:
        return None
    freqs, *rest = output if isinstance(output, tuple) else (output,)
    if int(positions.max()) >= freqs.shape[0]:
        raise ValueError(f"position {int(positions.max())} beyond the {freqs.shape[0]} RoPE "
                         "positions computed for this sequence")
    per_token = freqs[:, 0][positions.t().to(freqs.device)]
    return (per_token, *rest) if isinstance(output, tuple) else per_token


def model_forward(model, batch: dict, hidden_states: bool = False, replay=None) -> torch.Tensor:
    """Run one stage of ``model`` on ``batch`` (``input_ids [b, t]``, optional ``attention_mask``
    and ``position_ids``); with ``hidden_states`` the last stage returns its final hidden states
    ``[b, t, h]``, not logits (see :func:`megatron_rlhf.models.output_head.hidden_states_out`).

    Without ``position_ids`` positions are 0..t-1 for every row; for packed rows that is fine
    because RoPE attention only sees relative positions within a sequence. ``position_ids``
    (shared prompts: a reply continues from its prompt's end, not from the previous reply's)
    reach RoPE through :func:`_rotary_modules`; they stay set until the stage's next forward,
    so that a recomputed layer (activation recompute, in the backward that follows) sees the
    same ones. Under sequence parallelism the rows are padded
    to a multiple of TP and the last stage's output is cut back to ``t``. ``replay``: the
    stage's :class:`~megatron_rlhf.models.routing_replay.RoutingReplay` (MoE routing replay or
    recording), told the micro-batch and the shape the model runs at.
    """
    tokens = batch["input_ids"].to(device())
    mask = batch.get("attention_mask")
    mask = None if mask is None else mask.to(device())
    length = tokens.shape[1]
    extra = -length % sequence_multiple(model)
    if extra:
        tokens, mask = _pad_sequence(tokens, mask, extra)
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    per_token = batch.get("position_ids")
    if per_token is not None:
        per_token = torch.nn.functional.pad(per_token, (0, extra)).to(tokens.device)
    for module in _rotary_modules(model):
        module._rlhf_positions = per_token
    if replay is not None:
        replay.before_forward(batch, *tokens.shape)
    if hidden_states:
        with hidden_states_out(model):
            output = model(tokens, positions, attention_mask=mask)
    else:
        output = model(tokens, positions, attention_mask=mask)
    stage = getattr(model, "module", model)
    return output[:, :length] if extra and stage.post_process else output


def run_schedule(model, groups: ParallelGroups, micro_batches: list[dict], forward_step,
                 forward_only: bool) -> list:
    """Megatron's pipeline schedule for ``groups``' layout over ``micro_batches`` (one shape if PP>1)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    extra = {}
    if groups.layout.pp > 1:
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        extra["p2p_communicator"] = P2PCommunicator(groups.pp, model.config)
    return get_forward_backward_func(pp_size=groups.layout.pp)(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=_round_up(max(b["input_ids"].shape[1] for b in micro_batches),
                             sequence_multiple(model)),
        micro_batch_size=max(b["input_ids"].shape[0] for b in micro_batches),
        forward_only=forward_only,
        collect_non_loss_data=forward_only,
        pg_collection=groups.collection,
        **extra,
    )


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@torch.no_grad()
def pipeline_forward(model, groups: ParallelGroups, micro_batches: list[dict[str, torch.Tensor]],
                     head: Callable[[torch.Tensor, dict], Any],
                     hidden_states: bool = False, replay=None) -> list[Any]:
    """Run every micro-batch through all pipeline stages, forward only.

    Each micro-batch holds ``input_ids [b, t]`` and optionally ``attention_mask [b, 1, t, t]``.
    ``head(output, batch)`` runs on the last stage with the model's output ``[b, t, V_local]``
    (policy; vocab-parallel) or ``[b, t, 1]`` (value), cut back to the batch's real shape.
    With ``hidden_states`` the head gets the final hidden states ``[b, t, h]`` instead.
    ``replay``: see :func:`model_forward`. Returns the heads' results in micro-batch order on the last stage, ``[]`` on other stages.
    """
    if not micro_batches:
        return []
    model.eval()
    if groups.layout.pp > 1:
        micro_batches = pad_to_common_shape(micro_batches)

    def forward_step(data_iterator, stage_model):
        batch = next(data_iterator)
        output = model_forward(stage_model, batch, hidden_states, replay)

        def collect(output_tensor, non_loss_data=True):
            rows, length = batch.get("real_shape", batch["input_ids"].shape)
            return head(output_tensor[:rows, :length], batch)

        return output, collect

    results = run_schedule(model, groups, micro_batches, forward_step, forward_only=True)
    return list(results) if groups.is_last_stage else []


def gather_vocab_parallel(logits: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """``[b, t, V/tp]`` per TP rank -> full ``[b, t, V]`` on every TP rank."""
    if groups.layout.tp == 1:
        return logits
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(logits.contiguous(), group=groups.tp)


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                        groups: ParallelGroups) -> torch.Tensor:
    """Per-token ``-log p(target)`` from vocab-parallel ``logits [b, t, V/tp]`` -> ``[b, t]``.

    The rows Megatron pads the vocabulary with are excluded from the softmax, so the result is
    the unpadded model's (Hugging Face's) cross-entropy, and padded ids get no probability.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    local = logits.shape[-1]
    first = groups.tp_rank * local
    padded = torch.arange(first, first + local, device=logits.device) >= vocab_size
    logits = logits.float().masked_fill(padded, torch.finfo(torch.float32).min)
    return vocab_parallel_cross_entropy(logits, targets.to(logits.device))
