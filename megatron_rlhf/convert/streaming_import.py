"""HF folder -> Megatron distributed checkpoint, streamed: memory bounded by a few tensors.

No rank holds the model. Each builds its stage on the meta device and hands megatron's own
``sharded_state_dict`` of it to ``dist_checkpointing.save`` (so keys, offsets, replicas, factories,
``common.pt`` and ``metadata.json`` are megatron's), with a save strategy that differs from
megatron's torch_dist one only in where the bytes come from: torch's own ``FileSystemWriter``
asks the planner for each shard's data when it writes it, and :class:`_FromHF` answers by reading
the HF tensors that make it (:func:`~megatron_rlhf.convert.weights.read_shard`), cutting this
rank's piece, and dropping it once written. Megatron's writer resolves every shard before writing
(it stages them for asynchronous saves), which is why the eager path held the model twice.

A rank's peak is therefore the largest Megatron parameter it writes plus the HF tensors merged
into it (a fused QKV or gate/up projection), whatever the model's size. ``--nproc-per-node K``
splits the work: pipeline stages and TP/EP ranks own different shards, and data-parallel
replicas share theirs out (megatron's fully parallel save), so each rank reads from HF only the
tensors it writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron_rlhf.checkpoint.hf_io import HFReader
from megatron_rlhf.convert.mapping import Rule, mapped_parameters
from megatron_rlhf.convert.weights import read_shard
from megatron_rlhf.distributed.layout import ParallelGroups
from megatron_rlhf.errors import UserError

ShardKey = tuple[str, tuple[int, ...]]  # (sharded key, global offset): one shard in a checkpoint


class _ParamReader:
    """Reads one Megatron parameter's local shard from HF, keeping the last one: megatron saves
    a gated MLP's fc1 as two shards (gate, up) that are views of the same parameter."""

    def __init__(self, reader: HFReader, sources: dict[str, Rule], groups: ParallelGroups):
        self.reader, self.sources, self.groups = reader, sources, groups
        self._last: tuple[str, torch.Tensor] | None = None

    def __call__(self, name: str, param: torch.Tensor) -> torch.Tensor:
        if self._last is None or self._last[0] != name:
            self._last = None  # free the previous one before reading the next
            shard = read_shard(self.reader, self.sources[name], self.groups, name, param.shape)
            self._last = (name, shard.to(param.dtype).contiguous())
        return self._last[1]


def shard_sources(sharded_state_dict, model, read: _ParamReader) -> dict[ShardKey, Callable]:
    """For every tensor shard megatron will save: a function returning its bytes from HF.

    A shard's data is a parameter of the (meta) model or a view of one (a layer axis prepended,
    a gate/up half); the view's size, stride and offset are replayed on the real tensor.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    names = {id(tensor): name for name, tensor in mapped_parameters(model)}
    sources: dict[ShardKey, Callable] = {}
    for sharded in nested_values(sharded_state_dict):
        if not isinstance(sharded, ShardedTensor) or not sharded.data.is_meta:
            continue
        base = sharded.data._base if sharded.data._base is not None else sharded.data
        name = names.get(id(base))
        if name is None or name not in read.sources:
            raise RuntimeError(f"checkpoint tensor {sharded.key} is not a mapped parameter")
        view = (sharded.data.size(), sharded.data.stride(), sharded.data.storage_offset())

        def make(name=name, base=base, view=view):
            real = read(name, base)  # contiguous, but maybe itself a slice of a larger tensor
            size, stride, offset = view
            return real.as_strided(size, stride, real.storage_offset() + offset)

        sources[(sharded.key, tuple(sharded.global_offset))] = make
    return sources


def _planner_class():
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class _FromHF(MCoreSavePlanner):
        """Megatron's save planner whose tensor data is read from HF when it is written."""

        def __init__(self, sources: dict[ShardKey, Callable], progress: bool):
            super().__init__(dedup_replicated_tensors=False, flatten_state_dict=False)
            self.sources = sources
            self.bar = tqdm(total=len(sources), desc="HF -> Megatron", unit="tensor",
                            disable=not progress)

        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            local = self.lookup_object(write_item.index)
            make = self.sources.get((write_item.index.fqn, tuple(write_item.index.offset)))
            if make is None:
                if local.is_meta:
                    raise RuntimeError(f"no HF source for checkpoint tensor {write_item.index}")
                return local  # a real tensor (built from the config, e.g. a rotary table)
            self.bar.update()
            return make().reshape(local.shape)

    return _FromHF


def _user_error_in(err) -> UserError | None:
    """The :class:`UserError` (a damaged HF file found mid-write) inside torch's wrapper of
    each rank's failure, so the CLI shows its one line instead of a traceback."""
    for failure in getattr(err, "failures", {}).values():
        cause = getattr(failure, "exc", failure)
        if isinstance(cause, UserError):
            return cause
    return None


def streaming_strategy(model, reader: HFReader, sources: dict[str, Rule], groups: ParallelGroups,
                       progress: bool = True):
    """A ``dist_checkpointing.save`` strategy writing ``model``'s (meta) sharded state dict with
    each shard's bytes read from ``reader`` as it is written."""
    from megatron.core.dist_checkpointing.strategies.torch import (TorchDistSaveShardedStrategy,
                                                                   _replace_state_dict_keys_with_sharded_keys,
                                                                   mcore_to_pyt_state_dict)
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.api import CheckpointException

    planner_class = _planner_class()
    read = _ParamReader(reader, sources, groups)
    params = dict(mapped_parameters(model))
    for name, rule in sources.items():  # every shape, before anything is written
        read_shard(reader, rule, groups, name, params[name].shape, meta=True)

    class _StreamingTorchDist(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir: Path):
            tensors = shard_sources(sharded_state_dict, model, read)
            sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica)
            pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, False)
            # One writer thread: the serial loader resolves one shard at a time, just before
            # writing it (several threads would each hold their own).
            writer = FileSystemWriter(checkpoint_dir, single_file_per_rank=True, thread_count=1)
            planner = planner_class(tensors, progress and dist.get_rank() == 0)
            try:
                dcp_save(pyt_state_dict, storage_writer=writer, planner=planner)
            except CheckpointException as err:
                raise _user_error_in(err) or err
            finally:
                planner.bar.close()

    strategy = _StreamingTorchDist("torch_dist", 1)
    if groups.layout.dp > 1:
        # Data-parallel replicas hold the same shards: megatron's wrapper hands each shard to one
        # of them (balanced by size), so K processes write about 1/K of the model each.
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
                                                                                FullyParallelSaveStrategyWrapper)

        strategy = FullyParallelSaveStrategyWrapper(strategy, groups.dp)
    return strategy

