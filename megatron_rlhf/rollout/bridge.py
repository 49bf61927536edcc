"""Weights from a trainer group into rollout engines on ranks of their own.

The trainer group and the rollout group are two torch.distributed worlds. A *bridge* is one more
process group joining the trainer rank that sends (rank 0 of the trainer group, which holds every
bucket's full HF tensors after the resharding sync) and every rank of the rollout group: gloo on
CPU, NCCL on GPU, met through a TCP store the sender hosts. Each bucket of the resharding sync's
plan travels as one flat broadcast; the receivers cut it by the plan (names and shapes, sent once
when the bridge opens) and hand it to their engine, so no rank holds more than one bucket beyond
its engine's weights. This is the broadcast-group delivery slime and verl use for engines on
other GPUs.
"""

from __future__ import annotations

import datetime
import json
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from megatron_rlhf.distributed.platform import platform_is_cpu

Plan = list[list[tuple[str, tuple[int, ...]]]]  # per bucket: (HF name, shape) in order


def bucket_plan(buckets) -> Plan:
    """The bridge's plan from the resharding sync's buckets of :class:`Entry`."""
    return [[(name, tuple(shape)) for entry in bucket for name, shape in entry.hf]
            for bucket in buckets]


class WeightBridge:
    """Rank 0 sends, ranks 1.. receive. ``device``: where the buffers live (the engine's)."""

    def __init__(self, host: str, port: int, rank: int, size: int, device: str = "cpu",
                 timeout_s: float = 600.0):
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timeout)
        self.rank, self.size, self.device = rank, size, torch.device(device)
        if platform_is_cpu():
            self.group = dist.ProcessGroupGloo(dist.PrefixStore("bridge", store), rank, size,
                                               timeout)
        else:
            self.group = dist.ProcessGroupNCCL(dist.PrefixStore("bridge", store), rank, size)
        self.plan: Plan | None = None
        self.dtype: torch.dtype | None = None

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()
        return tensor

    def share_plan(self, plan: Plan | None, dtype: torch.dtype | None) -> None:
        """The sender's plan and dtype to every receiver (once, when the bridge opens)."""
        # JSON, not pickle: the receivers run nothing they are sent.
        blob = json.dumps([plan, str(dtype)]).encode() if self.rank == 0 else b""
        size = self._broadcast(torch.tensor([len(blob)], dtype=torch.long, device=self.device))
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        if self.rank == 0:
            data.copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
        self._broadcast(data)
        plan, dtype_name = json.loads(data.cpu().numpy().tobytes())
        self.plan = [[(name, tuple(shape)) for name, shape in bucket] for bucket in plan]
        self.dtype = getattr(torch, dtype_name.removeprefix("torch."))

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]] | None]) -> int:
        """Rank 0: each bucket as one flat broadcast (``buckets`` yields None on trainer ranks
        that only take part in the gathers). Returns the buckets sent."""
        count = 0
        for named in buckets:
            if self.rank == 0:
                self._broadcast(torch.cat([t.reshape(-1).to(self.dtype) for _, t in named]))
            count += 1
        return count

    def receive(self, load: Callable[[list[tuple[str, torch.Tensor]]], None]) -> int:
        """Ranks 1..: every bucket of the plan into ``load`` (the engine's ``load_weights``)."""
        for bucket in self.plan:
            numel = sum(_numel(shape) for _, shape in bucket)
            flat = self._broadcast(torch.empty(numel, dtype=self.dtype, device=self.device))
            named, offset = [], 0
            for name, shape in bucket:
                count = _numel(shape)
                named.append((name, flat[offset:offset + count].view(shape)))
                offset += count
            load(named)
            del flat, named
        return len(self.plan)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
