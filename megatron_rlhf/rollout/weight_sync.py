"""Resharding weight sync: trainer layout (TP x PP x DP) -> the generator's HF-named weights.

The actor's parameters are cut into fixed-size buckets, each bucket owned by one pipeline stage.
For every bucket the owner stage all-gathers each TP-cut tensor over the TP group straight into
its full layout (replicated tensors need no collective) and each routed expert's tensor over the
expert-parallel group (every EP rank holds other experts under the same local name), renames
the tensors to Hugging Face names and, with PP > 1, packs them into one flat buffer broadcast
from the owner stage to the other stages. Every rank then hands the bucket's tensors to its own generator replica (which
keeps its TP shard of them). Data-parallel replicas each feed their own generator, so nothing
crosses DP groups. At any time a rank holds at most one extra bucket (plus its gathered shards).

A LoRA-adapted weight goes out merged: each rank first computes ``W + (alpha/rank) B A`` of its
own pieces (a new tensor; the trainer's ``W`` is not touched), then gathers and sends that as it
would the plain weight, so every engine (hf, SGLang, a separate rollout group) gets a plain model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from megatron_rlhf.convert.mapping import (REPLICATED, ROWS, layer_offsets, mapped_parameters, rule_for,
                                           tp_unshard)
from megatron_rlhf.distributed.layout import ParallelGroups
from megatron_rlhf.models.builder import uses_transformer_engine
from megatron_rlhf.models.hf_config import ModelArch
from megatron_rlhf.models.lora import adapters, merged_weight


@dataclass(frozen=True)
class Entry:
    """One Megatron parameter of one stage and the HF tensors it turns into."""

    stage: int
    name: str  # Megatron name, local to its stage
    local_shape: tuple[int, ...]  # this TP rank's shard
    hf: tuple[tuple[str, tuple[int, ...]], ...]  # (HF name, full shape) per produced tensor
    expert: bool = False  # a routed expert's: ``hf`` lists every EP rank's expert in rank order

    @property
    def hf_numel(self) -> int:
        return sum(_numel(shape) for _, shape in self.hf)


def _gather_cut(local: torch.Tensor, cut: str, group, size: int) -> torch.Tensor:
    """The full tensor from every rank's ``cut`` piece, gathered straight into its layout: for a
    row cut the gather buffer already is the full tensor (no packing or unsharding copy)."""
    if size == 1 or cut == REPLICATED:
        return local
    full = torch.empty((size * local.shape[0], *local.shape[1:]), dtype=local.dtype,
                       device=local.device)
    dist.all_gather_single(full, local.contiguous(), group=group)
    if cut != ROWS:
        full = tp_unshard(list(full.view(size, *local.shape).unbind(0)), cut)
    return full


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class WeightSync:
    """Plans buckets once (collectively) and streams them on every :meth:`sync`."""

    def __init__(self, model, arch: ModelArch, groups: ParallelGroups, padded_vocab: int,
                 bucket_bytes: int):
        self.model, self.arch, self.groups = model, arch, groups
        self.padded_vocab = padded_vocab
        self.dtype = next(model.parameters()).dtype
        self.bucket_bytes = max(int(bucket_bytes), 1)
        self._offsets = layer_offsets(model)
        self._local_spec = not uses_transformer_engine()
        self._experts_per_rank = arch.moe.num_experts // groups.layout.ep if arch.moe else 0
        # Optimizer steps update these tensors in place, so the map stays valid across syncs.
        self._params = dict(mapped_parameters(model))
        self._adapters = {f"{name}.weight": adapter for name, adapter in adapters(model)}
        mine = [self._entry(name, param) for name, param in self._params.items()]
        stages: list[list[Entry]] = [None] * groups.layout.pp
        dist.all_gather_object(stages, mine, group=groups.pp)
        self.buckets = self._plan([e for stage in stages for e in stage])
        self._pp_ranks = dist.get_process_group_ranks(groups.pp) if groups.layout.pp > 1 else None

    def _rule(self, name: str, ep_rank: int):
        return rule_for(name, self.arch, self.padded_vocab, self._offsets,
                        expert_offset=ep_rank * self._experts_per_rank, local_spec=self._local_spec)

    def _entry(self, name: str, param: torch.Tensor) -> Entry:
        rule = self._rule(name, 0)
        layout = self.groups.layout
        pieces = layout.etp if rule.expert else layout.tp
        full = tp_unshard([torch.empty(param.shape, device="meta")] * pieces, rule.tp_cut)
        owners = range(layout.ep) if rule.expert else [0]
        hf = tuple((n, tuple(t.shape)) for r in owners
                   for n, t in zip(self._rule(name, r).hf_names, rule.split(full)))
        return Entry(self.groups.pp_rank, name, tuple(param.shape), hf, rule.expert)

    def _plan(self, entries: list[Entry]) -> list[list[Entry]]:
        """Consecutive entries of one stage, up to ``bucket_bytes`` (a bigger tensor goes alone).

        A tied embedding shows up on the first and the last stage; only the first copy is sent.
        """
        seen: set[str] = set()
        buckets: list[list[Entry]] = []
        size = self.dtype.itemsize
        for entry in entries:
            if all(n in seen for n, _ in entry.hf):
                continue
            seen.update(n for n, _ in entry.hf)
            last = buckets[-1] if buckets else None
            if (last and last[0].stage == entry.stage and
                    (sum(e.hf_numel for e in last) + entry.hf_numel) * size <= self.bucket_bytes):
                last.append(entry)
            else:
                buckets.append([entry])
        return buckets

    @property
    def total_bytes(self) -> int:
        return sum(e.hf_numel for b in self.buckets for e in b) * self.dtype.itemsize

    def _gather_bucket(self, bucket: list[Entry]) -> list[tuple[str, torch.Tensor]]:
        """On the owner stage: the bucket's full HF tensors.

        Each TP-cut tensor is all-gathered straight from the parameter into a fresh buffer: for
        a row cut that buffer already *is* the full tensor, so neither a packed send buffer nor
        an unsharding copy is written (one full-bucket memory pass each; the sync is bound by
        memory bandwidth). Replicated tensors are not gathered at all.
        """
        named = []
        for entry in bucket:
            local = self._params[entry.name].detach()
            if entry.name in self._adapters:
                local = merged_weight(local, self._adapters[entry.name])
            rule = self._rule(entry.name, 0)
            if entry.expert:
                group, size = self.groups.etp, self.groups.layout.etp
            else:
                group, size = self.groups.tp, self.groups.layout.tp
            full = _gather_cut(local, rule.tp_cut, group, size)
            if entry.expert and self.groups.layout.ep > 1:
                ep = self.groups.layout.ep
                every = torch.empty((ep * full.shape[0], *full.shape[1:]), dtype=full.dtype,
                                    device=full.device)
                dist.all_gather_into_tensor(every, full.contiguous(), group=self.groups.ep)
                tensors = [t for expert in every.view(ep, *full.shape).unbind(0)
                           for t in rule.split(expert)]
            else:
                tensors = rule.split(full)
            named += [(n, t) for (n, _), t in zip(entry.hf, tensors)]
        return named

    def _broadcast(self, bucket: list[Entry], named: list | None) -> list[tuple[str, torch.Tensor]]:
        """PP > 1: the owner stage packs the bucket into one buffer and broadcasts it."""
        owner = bucket[0].stage
        if named is not None:
            flat = torch.cat([t.reshape(-1) for _, t in named])
        else:
            numel = sum(e.hf_numel for e in bucket)
            flat = torch.empty(numel, dtype=self.dtype, device=next(self.model.parameters()).device)
        dist.broadcast(flat, src=self._pp_ranks[owner], group=self.groups.pp)
        out, offset = [], 0
        for entry in bucket:
            for name, shape in entry.hf:
                count = _numel(shape)
                out.append((name, flat[offset:offset + count].view(shape)))
                offset += count
        return out

    def iter_buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Yield each bucket's ``(hf_name, full tensor)`` list on every rank, in plan order."""
        for bucket in self.buckets:
            mine = bucket[0].stage == self.groups.pp_rank
            named = self._gather_bucket(bucket) if mine else None
            if self._pp_ranks is not None:
                named = self._broadcast(bucket, named)
            yield named
            del named

    @torch.no_grad()
    def sync(self, load: Callable[[list[tuple[str, torch.Tensor]]], None]) -> dict[str, float]:
        """Stream every bucket into ``load`` (the local generator's ``load_weights``)."""
        count = 0
        for named in self.iter_buckets():
            load(named)
            count += 1
        return {"buckets": float(count), "bytes": float(self.total_bytes)}
