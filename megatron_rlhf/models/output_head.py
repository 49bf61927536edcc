"""Log-probs and entropy of chosen tokens straight from the last hidden states, in chunks.

The policy's output layer turns ``[tokens, hidden]`` into ``[tokens, vocab]`` logits: at a 150k
vocabulary that grid is the largest tensor of an update (and its float copies, softmax and
gradient are as large again). RL losses read only one number per token (the target's
log-prob) and the entropy, and only at response positions. Here the output layer is skipped in
the model (:func:`hidden_states_out`), the positions the loss reads are picked from the hidden
states, and :class:`ChunkedTokenLogprobs` runs the output matmul over ``chunk`` tokens at a time,
keeping per token only what the backward pass needs (log-sum-exp and the mean logit) and
recomputing the chunk's logits there: the technique of verl's linear cross-entropy and slime's
chunked fallback. Under tensor parallelism each rank holds a vocabulary slice of the weight
(vocab-parallel, as Megatron's output layer); the softmax statistics are reduced over the TP
group, and the hidden states' gradient is summed over it by the same region op the output layer
uses.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class OutputHead:
    """What turns hidden states into this rank's vocabulary slice of the logits.

    ``weight [V_local, h]`` covers vocabulary ids ``vocab_start .. vocab_start + V_local - 1``;
    ids from ``vocab_size`` on are Megatron's padding rows (no probability).
    """

    weight: torch.Tensor
    vocab_start: int
    vocab_size: int
    tp_group: object | None
    chunk: int = 1024

    @property
    def valid(self) -> int:
        """Rows of ``weight`` that are real vocabulary (the rest is padding)."""
        return max(0, min(self.weight.shape[0], self.vocab_size - self.vocab_start))


def _stage(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def output_head(model, vocab_size: int, tp_group, tp_rank: int, chunk: int) -> OutputHead | None:
    """The head of ``model``'s last stage: the weight its ``output_layer`` multiplies by (the
    embedding's when they are tied, as ``GPTModel`` passes it); None on other stages."""
    stage = _stage(model)
    if not stage.post_process:
        return None
    if stage.share_embeddings_and_output_weights:
        weight = stage.shared_embedding_or_output_weight()
    else:
        weight = stage.output_layer.weight
    return OutputHead(weight, tp_rank * weight.shape[0], vocab_size, tp_group, chunk)


@contextmanager
def hidden_states_out(model):
    """Within this block ``model`` (a policy ``GPTModel``, possibly wrapped) returns its last
    hidden states ``[b, t, h]`` (full sequence on every TP rank) instead of logits.

    The states pass the same region op the output layer applies to its input (a sequence-parallel
    all-gather, or an identity whose backward all-reduces over TP), so gradients reaching the
    transformer are the ones the output layer would send.
    """
    stage = _stage(model)
    layer = getattr(stage, "output_layer", None) if stage.post_process else None
    if layer is None:
        yield
        return
    from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region,
                                               gather_from_sequence_parallel_region)

    group = stage.pg_collection.tp

    def forward(hidden, weight=None, runtime_gather_output=None):
        del weight, runtime_gather_output  # the loss applies the weight (see output_head)
        if layer.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, group=group)
        else:
            hidden = copy_to_tensor_model_parallel_region(hidden, group=group)
        return _ContiguousGrad.apply(hidden), None

    layer.forward = forward
    try:
        yield
    finally:
        del layer.forward


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous. GPTModel transposes its output to
    ``[b, s, h]``, so the gradient arriving at the region op above is a transposed view, and
    gloo's all-reduce of a non-contiguous tensor returned wrong sums (a TP=2 test caught it)."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _all_reduce(tensor: torch.Tensor, group, op=None) -> torch.Tensor:
    if group is not None and group.size() > 1:
        dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=group)
    return tensor


class ChunkedTokenLogprobs(torch.autograd.Function):
    """``(hidden [N, h], targets [N]) -> (log p(target) [N], entropy [N])`` in fp32, with
    ``p = softmax(hidden @ weight.T / temperature)`` over the (unpadded, vocab-parallel)
    vocabulary, never holding more than ``chunk x V_local`` logits."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, head: OutputHead, temperature: float):
        ctx.set_materialize_grads(False)
        count = hidden.shape[0]
        logprob = torch.empty(count, dtype=torch.float32, device=hidden.device)
        lse, mean_z = torch.empty_like(logprob), torch.empty_like(logprob)
        for start in range(0, count, head.chunk):
            rows = slice(start, start + head.chunk)
            z = _chunk_logits(hidden[rows], weight, head, temperature)
            if z.shape[-1]:
                peak = _all_reduce(z.max(-1).values, head.tp_group, dist.ReduceOp.MAX)
            else:  # a TP rank holding only padding rows still takes part in the reductions
                peak = _all_reduce(torch.full_like(logprob[rows], -torch.inf), head.tp_group,
                                   dist.ReduceOp.MAX)
            e = torch.exp(z - peak[:, None])
            picked, hit = _target_columns(targets[rows], head)
            target_z = (z.gather(1, picked[:, None])[:, 0] * hit if z.shape[-1]
                        else torch.zeros_like(peak))
            sums = _all_reduce(torch.stack([e.sum(-1), (e * z).sum(-1), target_z]), head.tp_group)
            total, weighted, target_z = sums
            lse[rows] = peak + torch.log(total)
            mean_z[rows] = weighted / total
            logprob[rows] = target_z - lse[rows]
        ctx.save_for_backward(hidden, weight, targets, lse, mean_z)
        ctx.head, ctx.temperature = head, temperature
        return logprob, lse - mean_z

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, weight, targets, lse, mean_z = ctx.saved_tensors
        head, temperature = ctx.head, ctx.temperature
        valid = head.valid
        grad_hidden = torch.zeros_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        if (grad_logprob is None and grad_entropy is None) or not valid:
            return grad_hidden, grad_weight.to(weight.dtype), None, None, None
        for start in range(0, hidden.shape[0], head.chunk):
            rows = slice(start, start + head.chunk)
            z = _chunk_logits(hidden[rows], weight, head, temperature)
            p = torch.exp(z - lse[rows, None])
            g = torch.zeros_like(z)
            if grad_logprob is not None:  # d log p(t) / dz = onehot(t) - p
                picked, hit = _target_columns(targets[rows], head)
                g -= p * grad_logprob[rows, None]
                g.scatter_add_(1, picked[:, None], (grad_logprob[rows] * hit)[:, None])
            if grad_entropy is not None:  # dH / dz = -p (z - E_p[z])
                g -= p * (z - mean_z[rows, None]) * grad_entropy[rows, None]
            g /= temperature
            chunk_hidden = hidden[rows]
            grad_hidden[rows] = (g.to(weight.dtype) @ weight[:valid]).to(hidden.dtype)
            grad_weight[:valid] += g.t() @ chunk_hidden.float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, head: OutputHead,
                  temperature: float) -> torch.Tensor:
    """fp32 logits ``[n, valid]`` of the real vocabulary rows of this rank (the matmul in the
    model's dtype, then fp32, as Megatron's output layer followed by ``.float()``)."""
    z = (hidden @ weight[:head.valid].t()).float()
    return z / temperature if temperature != 1.0 else z


def _target_columns(targets: torch.Tensor, head: OutputHead) -> tuple[torch.Tensor, torch.Tensor]:
    """Local column of each target (0 where it is not on this rank) and whether it is here."""
    local = targets - head.vocab_start
    hit = (local >= 0) & (local < head.valid)
    return torch.where(hit, local, 0), hit.float()


def token_logprobs_from_hidden(hidden: torch.Tensor, targets: torch.Tensor, head: OutputHead,
                               temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``log p(target)`` and entropy ``[N]`` (fp32) of hidden states ``[N, h]``; gradients flow
    to ``hidden`` and to the head's weight (see :class:`ChunkedTokenLogprobs`)."""
    return ChunkedTokenLogprobs.apply(hidden, head.weight, targets.to(hidden.device), head,
                                      temperature)
