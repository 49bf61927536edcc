"""Move weights between an HF tensor source and a (possibly TP/PP-sharded) Megatron model."""

from __future__ import annotations

import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron_rlhf.convert.hf_io import HFReader
from megatron_rlhf.convert.mapping import (layer_offsets, mapped_parameters, rule_for, tp_shard,
                                           tp_unshard)
from megatron_rlhf.distributed.layout import ParallelGroups
from megatron_rlhf.errors import UserError
from megatron_rlhf.models.hf_config import ModelArch


def load_hf_weights(model, reader: HFReader, arch: ModelArch, groups: ParallelGroups,
                    padded_vocab: int, progress: bool = True, skip: tuple[str, ...] = (),
                    unused_ok: tuple[str, ...] = ()) -> None:
    """Copy this rank's shard of every Megatron parameter from the HF checkpoint, tensor by tensor.

    ``skip`` names Megatron parameters left as initialised (a new head); ``unused_ok`` names HF
    tensors deliberately dropped (the LM head when starting a reward model from an LM). Otherwise
    every HF tensor must be used by some pipeline stage: an unmapped one would silently change the
    model. Collective over the pipeline group when pp > 1.
    """
    offsets = layer_offsets(model)
    used: set[str] = set(unused_ok)
    params = [(n, p) for n, p in mapped_parameters(model) if n not in skip]
    show = progress and dist.get_rank() == 0
    for name, param in tqdm(params, desc="HF -> Megatron", unit="tensor", disable=not show):
        rule = rule_for(name, arch, padded_vocab, offsets)
        full = rule.merge([reader.get(hf_name) for hf_name in rule.hf_names])
        shard = tp_shard(full, rule.tp_cut, groups.tp_rank, groups.layout.tp)
        if shard.shape != param.shape:
            raise UserError(f"shape mismatch for {', '.join(rule.hf_names)}: the HF checkpoint gives "
                            f"{tuple(shard.shape)} for Megatron {name} {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(shard)
        used.update(rule.hf_names)
    if groups.layout.pp > 1:  # each stage loads its own layers: check the union of all stages
        stages: list[set[str]] = [set()] * groups.layout.pp
        dist.all_gather_object(stages, used, group=groups.pp)
        used = set().union(*stages)
    unused = sorted(set(reader.names()) - used)
    if unused:
        raise UserError(f"{len(unused)} HF tensors have no Megatron counterpart, e.g. {unused[0]!r}")


def iter_hf_tensors(model, arch: ModelArch, groups: ParallelGroups, padded_vocab: int):
    """Yield ``(hf_name, full_tensor)`` for the whole model, gathering TP shards as it goes.

    Needs every pipeline stage in this process (pp == 1); one full tensor exists at a time.
    """
    if groups.layout.pp != 1:
        raise ValueError("iter_hf_tensors needs pp == 1")
    offsets = layer_offsets(model)
    tp = groups.layout.tp
    for name, param in mapped_parameters(model):
        rule = rule_for(name, arch, padded_vocab, offsets)
        local = param.detach().contiguous()
        if tp > 1:
            shards = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(shards, local, group=groups.tp)
        else:
            shards = [local]
        full = tp_unshard(shards, rule.tp_cut)
        yield from zip(rule.hf_names, rule.split(full))
