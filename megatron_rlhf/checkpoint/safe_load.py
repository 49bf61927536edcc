"""Reading pickled checkpoint files without running code planted in them.

A checkpoint folder holds four kinds of pickled file, and a pickle can name any callable:

- ``model/.metadata``: torch's distributed-checkpoint index, which torch 2.13 reads with a bare
  ``pickle.load`` (``FileSystemReader.read_metadata``);
- ``model/__*.distcp``: tensors (torch reads them with ``weights_only=True``) and byte items
  (megatron's ``ShardedObject``s, e.g. ``_extra_state``), which torch's load planner unpickles
  without any restriction;
- ``model/common.pt``: megatron's non-sharded state (``torch.load`` with its default,
  ``weights_only=True``);
- ``rng/rank_*.pt``: our RNG states.

megatron-core builds its reader and planner inside its load strategy, so instead of patching
them :func:`check_torch_dist` reads every pickled byte megatron-core will read, before it reads
it, through unpicklers that admit only what those files legitimately hold: the ``.metadata``
classes below, and torch's ``weights_only`` set (tensors, containers, numbers, strings) for the
rest. ``checkpoint.model_ckpt.read_sharded``, the one place any checkpoint is loaded, calls it
first. Anything else is a :class:`RefusedCheckpointFile` naming the file and the class; nothing
from the file has run.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from megatron_rlhf.errors import UserError

# What torch 2.13's distributed checkpoint writes into .metadata (read off real ones: dense,
# MoE, distributed optimizer), by module.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem",
        "LoadItemType"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # maps a layout's name to torch's layout object
    "torch": {"Size"},
    # StorageMeta.checkpoint_id: the folder written to, a path object when the writer got one
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}

# RNG files written before the safe format held numpy's state as an ndarray; these rebuild a
# plain uint32 array and nothing else (an object array would need further, refused, globals).
LEGACY_RNG_GLOBALS = ("numpy._core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype",
                      "numpy.dtypes.UInt32DType")

# Transformer Engine keeps its FP8 metadata (``_extra_state``) as a BytesIO.
_BYTE_ITEM_GLOBALS = ("_io.BytesIO",)


class RefusedCheckpointFile(UserError):
    """A checkpoint file holds something no checkpoint of ours contains; it was not loaded."""


def _refused(path, name: str) -> RefusedCheckpointFile:
    return RefusedCheckpointFile(
        f"{path}: refused to unpickle {name}, which no checkpoint file holds (a checkpoint "
        "holds tensors, numbers and strings); nothing from the file was run. Replace the "
        "checkpoint with a trusted copy")


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None),
                                            (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise _refused(self.path, f"{module}.{name}")


def read_metadata(path: str | os.PathLike):
    """A distributed checkpoint's ``.metadata``, unpickled with only its own classes admitted."""
    with open(path, "rb") as handle:
        try:
            return _MetadataUnpickler(handle, path).load()
        except RefusedCheckpointFile:
            raise
        except Exception as err:  # truncated, or not a pickle at all
            raise UserError(f"{path}: {type(err).__name__}: {err}") from None


def _resolve(names: tuple[str, ...]) -> list:
    import importlib

    found = []
    for dotted in names:
        module, _, name = dotted.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # another numpy's layout: nothing to admit
            continue
    return found


def load_torch_file(path: str | os.PathLike, allow: tuple[str, ...] = (),
                    data: bytes | None = None) -> Any:
    """``torch.load(weights_only=True)`` of ``path`` (or of ``data``, an item inside ``path``),
    admitting also the globals named in ``allow``; a refusal names the file and the global."""
    source = io.BytesIO(data) if data is not None else path
    try:
        with torch.serialization.safe_globals(_resolve(allow)):
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        raise _refused(path, found.group(1) if found else "an object") from None
    except Exception as err:
        text = " ".join(str(err).split())[:200]
        raise UserError(f"{path}: {type(err).__name__}: {text}") from None


_CHECKED: set[tuple] = set()  # folders already checked, with their files' sizes and times


def check_torch_dist(model_dir: str | os.PathLike) -> None:
    """Read every pickled byte of a torch_dist checkpoint folder through the restricted
    unpicklers: ``.metadata``, ``common.pt`` and each byte item in the ``.distcp`` files.
    A folder is checked once per process while its files stay the same (an export reads one
    checkpoint shard by shard)."""
    model_dir = Path(model_dir)
    try:
        stamp = (str(model_dir.resolve()),) + tuple(
            (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(model_dir.iterdir()))
    except OSError:
        stamp = None
    if stamp in _CHECKED:
        return
    _check(model_dir)
    if stamp is not None:
        _CHECKED.add(stamp)


def _check(model_dir: Path) -> None:
    import json

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    try:  # megatron-core picks its loader by this file: only torch_dist's is checked here
        backend = json.loads((model_dir / "metadata.json").read_text()).get("sharded_backend")
    except (OSError, ValueError, AttributeError) as err:
        raise UserError(f"{model_dir / 'metadata.json'}: {err}") from None
    if backend != "torch_dist":
        raise UserError(f"{model_dir / 'metadata.json'}: sharded_backend {backend!r}; "
                        "megatron_rlhf checkpoints are torch_dist")
    if not (model_dir / ".metadata").is_file():
        raise UserError(f"{model_dir}: no .metadata (not a complete distributed checkpoint)")
    metadata = read_metadata(model_dir / ".metadata")
    if (model_dir / "common.pt").is_file():
        load_torch_file(model_dir / "common.pt")
    byte_keys = {key for key, item in metadata.state_dict_metadata.items()
                 if isinstance(item, BytesStorageMetadata)}
    items = [(index, info) for index, info in (metadata.storage_data or {}).items()
             if index.fqn in byte_keys]
    for index, info in sorted(items, key=lambda item: (item[1].relative_path, item[1].offset)):
        path = model_dir / info.relative_path
        if info.transform_descriptors:  # compressed or encrypted: not what megatron writes
            raise UserError(f"{path}: byte item {index.fqn} is stored with transforms "
                            f"{list(info.transform_descriptors)}, which this reader does not check")
        try:
            with open(path, "rb") as handle:
                handle.seek(info.offset)
                data = handle.read(info.length)
        except OSError as err:
            raise UserError(f"{path}: {err}") from None
        load_torch_file(path, _BYTE_ITEM_GLOBALS, data)
