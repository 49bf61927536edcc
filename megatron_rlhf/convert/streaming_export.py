"""Megatron checkpoint -> HF safetensors folder, streamed: memory bounded by one output shard.

No rank ever holds the model. Each builds it on the meta device (shapes and dtypes, no storage)
to learn from megatron's own ``sharded_state_dict`` where every parameter lives in the
checkpoint, and from :func:`~megatron_rlhf.convert.mapping.rule_for` which HF tensors it becomes.
From those sizes every rank computes the same :class:`ExportPlan`: parameters in
``mapped_parameters`` order, packed into shards of at most ``max_shard_bytes`` (one parameter's
HF tensors are never split over two shards). Shard ``i`` is written by rank ``i % world``, which
loads exactly that shard's parameters (one ``dist_checkpointing.load`` of a subset), splits them
into HF tensors, writes the file and frees them: a rank's peak is one shard plus the one tensor
being read, merged or split. File names and the index come from the plan, so ranks agree on
them without talking; only the loads themselves are collective (torch's checkpoint reader
exchanges read plans), so ranks run them in lockstep, an empty one when a rank has no shard left.
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron_rlhf.checkpoint.model_ckpt import CheckpointInfo, read_sharded
from megatron_rlhf.convert import compare
from megatron_rlhf.checkpoint.hf_io import copy_hf_assets, shard_file_name, write_index, write_shard
from megatron_rlhf.convert.mapping import Rule, layer_offsets, mapped_parameters, rule_for
from megatron_rlhf.distributed.layout import ParallelGroups
from megatron_rlhf.models.builder import build_meta_model, uses_transformer_engine
from megatron_rlhf.models.lora import apply_lora


def meta_model(info: CheckpointInfo, groups: ParallelGroups):
    """The checkpoint's model under ``groups`` (TP=PP=EP=1 for an export) with every parameter
    and buffer on the meta device: its names, shapes and sharded keys, without its bytes; with
    the checkpoint's LoRA adapters, if any."""
    model = build_meta_model(info.arch, groups, info.dtype, info.padded_vocab)
    if info.lora is not None:
        apply_lora(model, info.lora)
    return model


def _adapter_keys(name: str) -> tuple[str, str]:
    """The checkpoint entries of the LoRA adapter on Megatron weight ``name`` (A, B)."""
    stem = name.removesuffix("weight")
    return f"{stem}adapter.lora_a", f"{stem}adapter.lora_b"


@dataclass(frozen=True)
class ParamExport:
    """One Megatron parameter: its bytes as loaded and the HF tensors (name, shape) it becomes."""

    name: str
    nbytes: int
    hf: tuple[tuple[str, torch.Size], ...]
    dtype: torch.dtype
    rule: Rule = dataclasses.field(compare=False, repr=False)

    @property
    def hf_bytes(self) -> int:
        return sum(shape.numel() for _, shape in self.hf) * self.dtype.itemsize


@dataclass(frozen=True)
class ExportPlan:
    """Which HF tensors go to which file; identical on every rank."""

    shards: tuple[tuple[ParamExport, ...], ...]

    def file_name(self, index: int) -> str:
        return shard_file_name(index, len(self.shards))

    def weight_map(self) -> dict[str, str]:
        return {hf_name: self.file_name(index) for index, shard in enumerate(self.shards)
                for param in shard for hf_name, _ in param.hf}

    def total_size(self) -> int:
        return sum(param.hf_bytes for shard in self.shards for param in shard)

    def rounds(self, rank: int, world: int) -> list[int | None]:
        """This rank's shard in each lockstep round (``None``: nothing left, load nothing)."""
        count = -(-len(self.shards) // world)
        return [i if i < len(self.shards) else None
                for i in range(rank, count * world, world)]


def pack_shards(params: list[ParamExport],
                max_shard_bytes: int) -> tuple[tuple[ParamExport, ...], ...]:
    """Greedy, in order: a shard closes when the next parameter would take it past the limit.

    Counted in loaded bytes (at least the HF bytes: padded vocab rows are dropped on export), so
    both a shard file and a rank's load stay under the limit; a parameter larger than the limit
    is a shard of its own.
    """
    shards: list[list[ParamExport]] = [[]]
    size = 0
    for param in params:
        if shards[-1] and size + param.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(param)
        size += param.nbytes
    return tuple(tuple(shard) for shard in shards)


def plan_export(model, info: CheckpointInfo, max_shard_bytes: int) -> ExportPlan:
    """The plan for a meta model: HF shapes come from each rule's own split, run on meta."""
    offsets = layer_offsets(model)
    local_spec = not uses_transformer_engine()
    params = []
    for name, tensor in mapped_parameters(model):
        rule = rule_for(name, info.arch, info.padded_vocab, offsets, local_spec=local_spec)
        shapes = [piece.shape for piece in rule.split(tensor)]
        params.append(ParamExport(name, tensor.numel() * tensor.element_size(),
                                  tuple(zip(rule.hf_names, shapes)), tensor.dtype, rule))
    return ExportPlan(pack_shards(params, max_shard_bytes))


def _without_prepended_axes(entry):
    """``entry`` with its prepended (stacked-layer) axes made ordinary size-1 axes.

    megatron-core 0.16.1 maps an entry with prepended axes to a grid-shaped torch ShardedTensor
    whose non-local grid cells it assigns to rank ``(rank + 1) % world``: in a one-process world
    that is rank 0 itself, so loading some layers of a stacked key fails ("Number of local
    shards (1) does not match ..."). Without prepended axes it reads exactly the local chunk.
    """
    if entry.prepend_axis_num == 0:
        return entry
    shape = (1,) * entry.prepend_axis_num + tuple(entry.local_shape)
    return dataclasses.replace(entry, data=entry.data.view(shape), local_shape=shape,
                               prepend_axis_num=0)


def _map(fn, tree):
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace

    return dict_list_map_outplace(fn, tree)


def _reshape(loaded, shapes):
    """``loaded`` (a tensor, or a factory's list/dict of them) viewed leaf by leaf as ``shapes``."""
    if isinstance(shapes, dict):
        return {key: _reshape(loaded[key], value) for key, value in shapes.items()}
    if isinstance(shapes, list):
        return [_reshape(part, shape) for part, shape in zip(loaded, shapes)]
    return loaded.view(shapes)


def _loadable(entry):
    """(what to ask ``dist_checkpointing.load`` for, the local shapes to restore) for one meta
    entry, backed by empty CPU tensors. A factory (SwiGLU fc1: gate and up halves stored apart)
    is built here, so that its merge runs one tensor at a time instead of for a whole batch."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    entry = copy.copy(entry)
    entry.data = torch.empty(entry.data.shape, dtype=entry.data.dtype, device="cpu")
    parts = entry.build() if isinstance(entry, ShardedTensorFactory) else entry
    return _map(_without_prepended_axes, parts), _map(lambda part: part.local_shape, parts)


def _full(loaded: dict, shapes: dict, sharded: dict, name: str) -> torch.Tensor:
    full = _reshape(loaded.pop(name), shapes[name])
    return sharded[name].merge_fn(full) if isinstance(full, (list, dict)) else full


def load_hf_tensors(sharded: dict, params: tuple[ParamExport, ...], path: Path,
                    lora_scale: float = 0.0) -> dict:
    """Load ``params`` from the checkpoint and return their HF tensors in plan order; collective
    (every rank calls it once per round, with an empty ``params`` when it has nothing to do).
    A weight with a LoRA adapter comes out merged: ``W + lora_scale * B @ A`` (in fp32)."""
    wanted, shapes = {}, {}
    for param in params:
        for name in (param.name, *_adapter_keys(param.name)):
            if name in sharded:
                wanted[name], shapes[name] = _loadable(sharded[name])
    loaded = read_sharded(wanted, path, whole=False)  # collective
    del wanted  # so that a tensor replaced by its split (QKV's copies) is freed at once
    tensors = {}
    for param in params:
        full = _full(loaded, shapes, sharded, param.name)
        a_key, b_key = _adapter_keys(param.name)
        if a_key in loaded:
            a, b = _full(loaded, shapes, sharded, a_key), _full(loaded, shapes, sharded, b_key)
            full = (full.float() + lora_scale * (b.float() @ a.float())).to(full.dtype)
        pieces = param.rule.split(full)
        del full
        tensors.update(zip((name for name, _ in param.hf), pieces))
    return tensors


def _return_freed_tensors_to_the_os() -> None:
    """Make every freed tensor leave the resident set at once (glibc; elsewhere a no-op).

    glibc raises its mmap threshold after each large free (up to 32 MiB), after which tensors
    come from the heap and freed ones stay resident: measured, each 500 MB shard then left
    ~220 MB behind for the next. A fixed 1 MiB threshold gives each tensor its own mapping.
    """
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 2**20)  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _prepare(partial: Path) -> None:
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()


def _finish(plan: ExportPlan, info: CheckpointInfo, partial: Path, out: Path) -> None:
    """Rank 0, once every shard is written: index, config and tokenizer, then the rename."""
    if len(plan.shards) > 1:
        write_index(partial, plan.weight_map(), plan.total_size())
    copy_hf_assets(info.hf_dir, partial)
    if out.exists():
        out.rmdir()  # empty: checked before anything was written
    partial.rename(out)


def export_hf(info: CheckpointInfo, out: Path, groups: ParallelGroups,
              max_shard_bytes: int, verify: bool = True) -> Path:
    """Write ``info``'s model as an HF folder at ``out``; every rank calls this.

    Shards go to ``out.partial``, renamed to ``out`` once all are written, so a killed export
    never leaves a folder that looks finished. ``out`` must be on a filesystem all ranks share.
    ``verify``: each shard is read back from its file and compared with what was written.
    """
    if groups.layout.tp * groups.layout.pp * groups.layout.ep != 1:
        raise ValueError("export_hf reads the full model: build groups with tp=pp=ep=1")
    _return_freed_tensors_to_the_os()
    model = meta_model(info, groups)
    plan = plan_export(model, info, max_shard_bytes)
    sharded = model.sharded_state_dict()
    partial = out.with_name(out.name + ".partial")
    _prepare(partial)
    rank, world = dist.get_rank(), dist.get_world_size()
    rounds = plan.rounds(rank, world)
    found = None
    for index in tqdm(rounds, desc="Megatron -> HF", unit="shard", disable=rank != 0):
        params = plan.shards[index] if index is not None else ()
        tensors = load_hf_tensors(sharded, params, info.path,
                                  info.lora.scale if info.lora is not None else 0.0)
        if index is not None:
            write_shard(partial / plan.file_name(index), tensors)
            if verify and found is None:
                found = compare.check_written_shard(partial / plan.file_name(index), tensors)
        del tensors
    if verify:
        compare.agree(found, "convert mcore-to-hf", partial)
        if rank == 0:
            print(f"verified: {len(plan.weight_map())} tensors read back from the written files "
                  "equal what was written, bitwise", flush=True)
    dist.barrier()
    if rank == 0:
        _finish(plan, info, partial, out)
    dist.barrier()
    return out
