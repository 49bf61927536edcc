"""Conversions read back what they wrote and compare it with their source, bitwise.

``convert hf-to-mcore`` re-reads the checkpoint it has just written the way ``mcore-to-hf``
reads one (shard by shard, as HF tensors, vocabulary padding dropped) and compares every tensor
with the Hugging Face source; ``mcore-to-hf`` re-reads each safetensors file right after
writing it and compares it with the tensors it wrote. Memory stays as the conversions bound
it: one output shard plus one tensor per process. A mismatch is a :class:`UserError` naming
the tensor, raised on every rank before the output is renamed into place, so the output is
left as ``OUT.partial`` (incomplete, never taken for a finished one).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rlhf.convert.compare import agree, differs


def verify_checkpoint_against_hf(checkpoint: Path, hf_dir: str, arch, padded_vocab: int,
                                 dtype: torch.dtype, max_shard_bytes: int = 256 * 2**20) -> int:
    """Every tensor of the (not yet committed) checkpoint folder ``checkpoint``, read back as
    the export reads it (shards of ``max_shard_bytes``), against the HF folder it came from;
    returns how many were compared. Collective; it rebuilds the world's groups at TP=PP=EP=1
    (the export's layout)."""
    from megatron_rlhf.checkpoint.model_ckpt import CheckpointInfo
    from megatron_rlhf.checkpoint.hf_io import HFReader
    from megatron_rlhf.convert.streaming_export import load_hf_tensors, meta_model, plan_export
    from megatron_rlhf.convert.weights import mtp_tensor_names
    from megatron_rlhf.distributed.layout import ParallelLayout, build_parallel_groups

    info = CheckpointInfo(checkpoint, arch, padded_vocab, dtype)
    groups = build_parallel_groups(ParallelLayout(), arch.shape)
    model = meta_model(info, groups)
    plan = plan_export(model, info, max_shard_bytes)
    sharded = model.sharded_state_dict()
    reader = HFReader(hf_dir, mmap=False)
    covered = set(plan.weight_map())
    dropped = set(mtp_tensor_names(reader, arch, say=False))  # said by the import itself
    uncovered = sorted(set(reader.names()) - covered - dropped)
    found = f"{uncovered[0]}: in the source, not in the checkpoint" if uncovered else None
    for index in plan.rounds(dist.get_rank(), dist.get_world_size()):
        params = plan.shards[index] if index is not None else ()
        tensors = load_hf_tensors(sharded, params, checkpoint)  # collective, in lockstep
        for name in list(tensors):
            if found is None:
                found = differs(name, tensors[name], reader.get(name))
            del tensors[name]
    agree(found, "convert hf-to-mcore", checkpoint)
    return len(covered)
