"""Hugging Face safetensors folders: read one tensor at a time; name, write and index shards.

Reading holds one tensor at a time; writing one shard (see ``convert/streaming_export.py``), so
converting never needs a full copy of a model in memory.
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
