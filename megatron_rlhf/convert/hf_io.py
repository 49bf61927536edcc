"""Streaming access to Hugging Face safetensors folders: read one tensor at a time, write shard by shard.

Neither side ever holds more than one tensor (reading) or one output shard (writing) beyond the
Megatron model itself, so converting never needs two full copies of a model in memory.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_rlhf.errors import UserError

# Files copied verbatim between HF folders and our checkpoints (config, tokenizer, generation).
HF_ASSET_PATTERNS = ("config.json", "generation_config.json", "tokenizer*", "vocab.json",
                     "merges.txt", "special_tokens_map.json", "chat_template.*", "*.tiktoken",
                     "tokenizer.model", "added_tokens.json")


def _open(path: Path):
    """``safe_open`` whose failure on a damaged file (truncated download, wrong format) names it."""
    try:
        return safe_open(path, "pt")
    except Exception as err:  # SafetensorError is not exported under a stable name
        raise UserError(f"{path}: not a readable safetensors file ({err})") from None


class HFReader:
    """Lazy tensor reader over ``model.safetensors`` or a sharded ``*.index.json`` folder."""

    def __init__(self, hf_dir: str | os.PathLike):
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

    def names(self) -> list[str]:
        return list(self.files)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise UserError(f"tensor {name!r} is missing from {self.dir}")
        file = self.files[name]
        if file not in self._handles:
            path = self.dir / file
            if not path.is_file():
                raise UserError(f"missing weight file {path}")
            self._handles[file] = _open(path)
        try:
            return self._handles[file].get_tensor(name)
        except Exception as err:  # safetensors raises its own SafetensorError
            raise UserError(f"{self.dir / file}: cannot read tensor {name!r} ({err})") from None

    def dtype(self) -> torch.dtype:
        """The checkpoint's floating dtype, read from its stored tensors (not the config)."""
        for name in self.files:
            tensor = self.get(name)
            if tensor.is_floating_point():
                return tensor.dtype
        raise UserError(f"no floating-point tensors in {self.dir}")


class ShardedWriter:
    """Writes tensors in arrival order into ``model-0000k-of-0000n.safetensors`` shards."""

    def __init__(self, out_dir: str | os.PathLike, max_shard_bytes: int = 5 * 2**30):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().contiguous().cpu()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        index = len(self._shards)
        save_file(self._pending, self.dir / f".shard-{index:05d}.safetensors",
                  metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        if self._pending or not self._shards:
            self._flush()
        count = len(self._shards)
        if count == 1:
            os.replace(self.dir / ".shard-00000.safetensors", self.dir / "model.safetensors")
            return
        weight_map = {}
        for index, names in enumerate(self._shards):
            final = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self.dir / f".shard-{index:05d}.safetensors", self.dir / final)
            weight_map.update({name: final for name in names})
        index_doc = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.dir / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=2))


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
