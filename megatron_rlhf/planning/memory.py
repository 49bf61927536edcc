"""Bytes of a trained model's state on one rank: weights, gradients and optimizer state, as
megatron-core allocates them for the options :func:`megatron_rlhf.trainers.engine.make_trainable`
uses (``grad_reduce_in_fp32=True``, Adam, no overlapped gradient reduction).

Megatron's DDP puts a rank's gradients in one contiguous buffer per kind of parameter (dense
ones, reduced over the data-parallel group; routed experts', over the expert data-parallel
group), filled in reverse registration order. With the distributed optimizer each parameter
starts at a multiple of 64 elements, each bucket ends at a multiple of ``lcm(dp, 128)``, a tied
embedding of a pipeline end is a bucket of its own, and the parameters themselves move into a
buffer of the same layout; each data-parallel rank then owns ``1/dp`` of every bucket and keeps
Adam's moments (and fp32 main weights of bf16 parameters) for the elements of real parameters
inside its share. Without it every rank keeps them for all its parameters. Tested against what
megatron allocates after one optimizer step (tests/test_planner_memory.py).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from megatron_rlhf.planning.params import Tensor

GRAD_BYTES = 4  # grad_reduce_in_fp32=True
ADAM_MOMENTS = 2  # exp_avg, exp_avg_sq, fp32


@dataclass(frozen=True)
class Buffer:
    """One DDP gradient buffer: its padded size and where its real elements lie."""

    numel: int
    buckets: list[tuple[int, int]]  # (start, end), padded
    spans: list[tuple[int, int]]  # (start, end) of each parameter, ascending
    dp: int  # ranks its buckets are sharded over (the distributed optimizer)

    def __post_init__(self):
        object.__setattr__(self, "starts", [s for s, _ in self.spans])

    def real_in(self, start: int, end: int) -> int:
        """Elements of parameters (not padding) in ``[start, end)``."""
        count = 0
        first = max(bisect.bisect_right(self.starts, start) - 1, 0)
        for s, e in self.spans[first:]:
            if s >= end:
                break
            count += max(0, min(e, end) - max(s, start))
        return count

    def shard_real(self, rank: int) -> int:
        """Real elements data-parallel rank ``rank`` owns (its optimizer's share)."""
        total = 0
        for start, end in self.buckets:
            size = (end - start) // self.dp
            total += self.real_in(start + rank * size, start + (rank + 1) * size)
        return total

    def max_shard_real(self) -> int:
        """The most real elements any data-parallel rank owns."""
        return max(self.shard_real(rank) for rank in range(self.dp))


def _pad(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def grad_buffer(tensors: list[Tensor], dp: int, distributed: bool) -> Buffer:
    """Megatron's ``_ParamAndGradBuffer`` layout for ``tensors`` (registration order) with one
    bucket per buffer (``overlap_grad_reduce=False``)."""
    bucket_end_multiple = math.lcm(dp, 128)
    buckets, spans, start, bucket_start, in_bucket = [], [], 0, 0, 0
    end = 0
    for tensor in reversed(tensors):
        if distributed:
            start = _pad(start, 64)
        own_bucket = tensor.shared_embedding and distributed
        if own_bucket and in_bucket:
            closed = _pad(start, bucket_end_multiple)
            buckets.append((bucket_start, closed))
            start = bucket_start = closed
            in_bucket = 0
        end = start + tensor.numel
        spans.append((start, end))
        in_bucket += 1
        if own_bucket:
            closed = _pad(end, bucket_end_multiple)
            buckets.append((bucket_start, closed))
            start = bucket_start = closed
            in_bucket = 0
        else:
            start = end
    if in_bucket:
        closed = _pad(end, bucket_end_multiple) if distributed else end
        buckets.append((bucket_start, closed))
    numel = buckets[-1][1] if buckets else 0
    return Buffer(numel, buckets, sorted(spans), dp if distributed else 1)


@dataclass(frozen=True)
class StateBytes:
    """Per-rank bytes of one trained model's state."""

    weights: int
    gradients: int
    optimizer: int  # on the GPU
    optimizer_offloaded: int  # the same state when megatron-core's optimizer CPU offload holds it


def train_state_bytes(tensors: list[Tensor], dp: int, expert_dp: int, param_bytes: int,
                      distributed: bool, offload: bool = False,
                      ranks: tuple[int, int] | None = None) -> StateBytes:
    """Weights, gradients and Adam state of one rank holding ``tensors``. ``param_bytes``: 2
    (bf16, with fp32 main weights in the optimizer) or 4 (fp32, the parameters are the main
    weights). ``offload``: megatron-core's ``optimizer_cpu_offload`` (fraction 1) keeps the
    optimizer state and main weights in host memory. ``ranks``: (data-parallel, expert
    data-parallel) rank whose optimizer share to count; default the largest share."""
    dense = [t for t in tensors if not t.expert and not t.frozen]
    experts = [t for t in tensors if t.expert and not t.frozen]
    per_element = 4 * (ADAM_MOMENTS + (1 if param_bytes < 4 else 0))
    # A LoRA run's frozen base: held as built, outside DDP's buffers and the optimizer.
    weights, gradients, optimizer = sum(t.numel for t in tensors if t.frozen) * param_bytes, 0, 0
    for which, (members, size) in enumerate(((dense, dp), (experts, expert_dp))):
        if not members:
            continue
        buffer = grad_buffer(members, size, distributed)
        gradients += buffer.numel * GRAD_BYTES
        if distributed:
            weights += buffer.numel * param_bytes  # the parameters move into a padded buffer
            share = buffer.max_shard_real() if ranks is None else buffer.shard_real(ranks[which])
            optimizer += share * per_element
        else:
            real = sum(t.numel for t in members)
            weights += real * param_bytes
            optimizer += real * per_element
    state = StateBytes(weights, gradients, optimizer, 0)
    return offloaded(state) if offload else state


def offloaded(state: StateBytes) -> StateBytes:
    """``state`` (computed on the GPU) with its optimizer share held by the optimizer's CPU
    offload instead: the same bytes, in host memory."""
    return StateBytes(state.weights, state.gradients, 0, state.optimizer + state.optimizer_offloaded)
