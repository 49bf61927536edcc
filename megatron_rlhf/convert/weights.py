"""Move weights between an HF tensor source and a (possibly TP/PP-sharded) Megatron model."""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron_rlhf.checkpoint.hf_io import HFReader
from megatron_rlhf.convert.mapping import (Rule, layer_offsets, mapped_parameters, rule_for,
                                           tp_shard)
from megatron_rlhf.distributed.layout import ParallelGroups
from megatron_rlhf.errors import UserError
from megatron_rlhf.models.builder import uses_transformer_engine
from megatron_rlhf.models.hf_config import ModelArch


def hf_sources(model, reader: HFReader, arch: ModelArch, groups: ParallelGroups, padded_vocab: int,
               skip: tuple[str, ...] = (), unused_ok: tuple[str, ...] = ()) -> dict[str, Rule]:
    """Megatron parameter name -> the :class:`Rule` that makes this rank's shard of it from HF.

    ``skip`` names Megatron parameters left as initialised (a new head); ``unused_ok`` names HF
    tensors deliberately dropped (the LM head when starting a reward model from an LM). Otherwise
    every HF tensor must be used by some rank (stages and expert-parallel ranks each take their
    own): an unmapped one would silently change the model. Reads no tensor; collective when the
    world has more than one rank.
    """
    offsets = layer_offsets(model)
    expert_offset = groups.expert_offset(arch.moe.num_experts if arch.moe else 0)
    local_spec = not uses_transformer_engine()
    sources = {name: rule_for(name, arch, padded_vocab, offsets, expert_offset=expert_offset,
                              local_spec=local_spec)
               for name, _ in mapped_parameters(model) if name not in skip}
    used = set(unused_ok) | set(mtp_tensor_names(reader, arch))
    used.update(hf for rule in sources.values() for hf in rule.hf_names)
    if dist.get_world_size() > 1:  # stages and EP ranks take their own tensors: check the union
        everyone: list[set[str]] = [set()] * dist.get_world_size()
        dist.all_gather_object(everyone, used)
        used = set().union(*everyone)
    unused = sorted(set(reader.names()) - used)
    if unused:
        raise UserError(f"{len(unused)} HF tensors have no Megatron counterpart, e.g. {unused[0]!r}")
    return sources


def read_shard(reader: HFReader, rule: Rule, groups: ParallelGroups, name: str,
               shape: torch.Size, meta: bool = False) -> torch.Tensor:
    """This rank's shard of Megatron parameter ``name`` (of local ``shape``), read from HF;
    ``meta``: only its shape, from the files' headers (checks a whole model before any write)."""
    read = reader.meta if meta else reader.get
    full = rule.merge([read(hf_name) for hf_name in rule.hf_names])
    rank, size = ((groups.etp_rank, groups.layout.etp) if rule.expert
                  else (groups.tp_rank, groups.layout.tp))
    shard = tp_shard(full, rule.tp_cut, rank, size)
    if shard.shape != shape:
        raise UserError(f"shape mismatch for {', '.join(rule.hf_names)}: the HF checkpoint gives "
                        f"{tuple(shard.shape)} for Megatron {name} {tuple(shape)}")
    return shard


def load_hf_weights(model, reader: HFReader, arch: ModelArch, groups: ParallelGroups,
                    padded_vocab: int, progress: bool = True, skip: tuple[str, ...] = (),
                    unused_ok: tuple[str, ...] = ()) -> None:
    """Copy this rank's shard of every Megatron parameter from the HF checkpoint, tensor by tensor
    (``skip``, ``unused_ok``: see :func:`hf_sources`). Collective when the world has more than
    one rank."""
    sources = hf_sources(model, reader, arch, groups, padded_vocab, skip, unused_ok)
    params = dict(mapped_parameters(model))
    show = progress and dist.get_rank() == 0
    for name, rule in tqdm(sources.items(), desc="HF -> Megatron", unit="tensor",
                           disable=not show):
        param = params[name]
        with torch.no_grad():
            param.copy_(read_shard(reader, rule, groups, name, param.shape))


def mtp_tensor_names(reader: HFReader, arch: ModelArch, say: bool = True) -> list[str]:
    """DeepSeek-V3's multi-token-prediction layers, stored after the decoder's last layer: we
    train without them, so importing drops them (and says so once; ``say=False``: silently)."""
    if not arch.mtp_layers:
        return []
    first = arch.num_layers
    pattern = re.compile(r"model\.layers\.(\d+)\.")
    names = [n for n in reader.names()
             if (m := pattern.match(n)) and int(m.group(1)) >= first]
    if names and say and dist.get_rank() == 0:
        print(f"[convert] dropping {len(names)} multi-token-prediction tensors "
              f"(model.layers.{first}.* and up): megatron-rlhf trains without MTP", flush=True)
    return names
