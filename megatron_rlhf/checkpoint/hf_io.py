"""Hugging Face safetensors folders: read one tensor at a time; name, write and index shards.

Reading holds one tensor at a time; writing one shard (see ``convert/streaming_export.py``), so
converting never needs a full copy of a model in memory.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_rlhf.errors import UserError

# Files copied verbatim between HF folders and our checkpoints (config, tokenizer, generation).
HF_ASSET_PATTERNS = ("config.json", "generation_config.json", "tokenizer*", "vocab.json",
                     "merges.txt", "special_tokens_map.json", "chat_template.*", "*.tiktoken",
                     "tokenizer.model", "added_tokens.json")


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                       "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
                       "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
                       "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_MAX_HEADER = 100 * 2**20  # safetensors' own limit


def _open(path: Path):
    """``safe_open`` whose failure on a damaged file (truncated download, wrong format) names it."""
    try:
        return safe_open(path, "pt")
    except Exception as err:  # SafetensorError is not exported under a stable name
        raise UserError(f"{path}: not a readable safetensors file ({err})") from None


class HFReader:
    """Lazy tensor reader over ``model.safetensors`` or a sharded ``*.index.json`` folder.

    safetensors memory-maps each file it opens, and every page read stays in the process's
    resident set while the file is open: a reader walking a whole model that way grows as large
    as the model's biggest file. ``mmap=False`` reads each tensor into its own buffer instead
    (see :func:`read_tensor`), so only the tensors still referenced occupy memory; conversions
    use it. The default keeps safetensors' reader (model loads that keep every tensor anyway).
    """

    def __init__(self, hf_dir: str | os.PathLike, mmap: bool = True):
        self.dir = Path(hf_dir)
        if not self.dir.is_dir():
            raise UserError(f"Hugging Face folder not found: {self.dir}")
        if not (self.dir / "config.json").is_file():
            raise UserError(f"missing config.json in {self.dir}")
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            self.files = json.loads(index.read_text())["weight_map"]
        elif (self.dir / "model.safetensors").is_file():
            with _open(self.dir / "model.safetensors") as handle:
                self.files = {name: "model.safetensors" for name in handle.keys()}
        else:
            raise UserError(f"no model.safetensors or model.safetensors.index.json in {self.dir}")
        self._handles = {}
        self._mmap = mmap
        self._headers: dict[str, dict] = {}

    def names(self) -> list[str]:
        return list(self.files)

    def _handle(self, name: str):
        if name not in self.files:
            raise UserError(f"tensor {name!r} is missing from {self.dir}")
        file = self.files[name]
        if file not in self._handles:
            path = self.dir / file
            if not path.is_file():
                raise UserError(f"missing weight file {path}")
            self._handles[file] = _open(path)
        return self._handles[file]

    def get(self, name: str) -> torch.Tensor:
        if not self._mmap:
            return self._read(name)
        handle = self._handle(name)
        try:
            return handle.get_tensor(name)
        except Exception as err:  # safetensors raises its own SafetensorError
            raise UserError(f"{self.dir / self.files[name]}: cannot read tensor {name!r} "
                            f"({err})") from None

    def _header(self, name: str) -> tuple[Path, dict]:
        if name not in self.files:
            raise UserError(f"tensor {name!r} is missing from {self.dir}")
        path = self.dir / self.files[name]
        if path.name not in self._headers:
            if not path.is_file():
                raise UserError(f"missing weight file {path}")
            self._headers[path.name] = read_header(path)
        return path, self._headers[path.name]

    def _read(self, name: str) -> torch.Tensor:
        self.meta(name)  # checks the header's entry
        path, header = self._header(name)
        return read_tensor(path, header, name)

    def meta(self, name: str) -> torch.Tensor:
        """A meta tensor with ``name``'s shape and dtype, from the file's header (no bytes)."""
        path, header = self._header(name)
        entry = header.get(name)
        if entry is None or entry.get("dtype") not in _SAFETENSORS_DTYPES:
            raise UserError(f"{path}: cannot read tensor {name!r} (not in the file's header or "
                            "of an unsupported dtype)")
        return torch.empty(entry["shape"], dtype=_SAFETENSORS_DTYPES[entry["dtype"]],
                           device="meta")

    def dtype(self) -> torch.dtype:
        """The checkpoint's floating dtype, read from its stored tensors (not the config)."""
        for name in self.files:
            tensor = self.get(name)
            if tensor.is_floating_point():
                return tensor.dtype
        raise UserError(f"no floating-point tensors in {self.dir}")


def read_header(path: Path) -> dict:
    """A safetensors file's header: tensor name -> {dtype, shape, data_offsets}, plus the
    offset its data starts at (``"__data_start__"``)."""
    try:
        with open(path, "rb") as file:
            (size,) = struct.unpack("<Q", file.read(8))
            if size > _MAX_HEADER:
                raise ValueError(f"header of {size} bytes")
            header = json.loads(file.read(size))
    except (OSError, ValueError, struct.error) as err:
        raise UserError(f"{path}: not a readable safetensors file ({err})") from None
    header.pop("__metadata__", None)
    header["__data_start__"] = 8 + size
    return header


def read_tensor(path: Path, header: dict, name: str) -> torch.Tensor:
    """Read one tensor of a safetensors file into a new buffer (no memory map)."""
    entry = header[name]
    start, end = entry["data_offsets"]
    dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
    buffer = torch.empty(end - start, dtype=torch.uint8)
    with open(path, "rb") as file:
        file.seek(header["__data_start__"] + start)
        if file.readinto(buffer.numpy()) != end - start:
            raise UserError(f"{path}: cannot read tensor {name!r} (the file is truncated)")
    return buffer.view(dtype).reshape(entry["shape"])


def shard_file_name(index: int, count: int) -> str:
    """HF's name for shard ``index`` (from 0) of ``count``; a lone one is ``model.safetensors``."""
    if count == 1:
        return "model.safetensors"
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_shard(path: str | os.PathLike, tensors: dict[str, torch.Tensor]) -> None:
    """One safetensors file. safetensors 0.8 (setup.py pins >=0.8) writes from the tensors' own
    memory, so saving costs no second copy of the shard."""
    save_file({name: t.detach().contiguous() for name, t in tensors.items()}, Path(path),
              metadata={"format": "pt"})


def write_index(out_dir: str | os.PathLike, weight_map: dict[str, str], total_size: int) -> None:
    """``model.safetensors.index.json`` of a sharded folder (``total_size``: tensor bytes)."""
    index_doc = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (Path(out_dir) / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=2))


def copy_hf_assets(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy config and tokenizer files (never weights) from ``src`` to ``dst``."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for pattern in HF_ASSET_PATTERNS:
        for path in src.glob(pattern):
            if path.is_file():
                shutil.copy2(path, dst / path.name)
                copied.append(path.name)
    return sorted(set(copied))
