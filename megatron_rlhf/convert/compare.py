"""Bitwise comparison of written tensors with their source, agreed by every rank: the pieces
both conversions' read-back checks (:mod:`megatron_rlhf.convert.verify`, the export's
per-file check) share."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rlhf.checkpoint.hf_io import read_header, read_tensor
from megatron_rlhf.errors import UserError


def _first_mismatch(found: str | None) -> str | None:
    """Every rank's finding, agreed: all ranks raise together or none does."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, found)
    return next((f for f in everyone if f is not None), None)


def differs(name: str, written: torch.Tensor, source: torch.Tensor) -> str | None:
    """Why ``written`` is not bitwise ``source``, or None."""
    if written.dtype != source.dtype or written.shape != source.shape:
        return (f"{name}: written as {written.dtype} {tuple(written.shape)}, source is "
                f"{source.dtype} {tuple(source.shape)}")
    if not torch.equal(written.view(torch.uint8) if written.is_floating_point() else written,
                       source.view(torch.uint8) if source.is_floating_point() else source):
        return f"{name}: written values differ from the source"
    return None


def check_written_shard(path: Path, tensors: dict[str, torch.Tensor]) -> str | None:
    """Read ``path`` back, tensor by tensor, against what was written into it."""
    header = read_header(path)
    missing = sorted(set(tensors) - set(header) - {"__data_start__"})
    if missing:
        return f"{missing[0]}: not in {path} after writing it"
    for name, tensor in tensors.items():
        problem = differs(name, read_tensor(path, header, name), tensor)
        if problem:
            return f"{path}: {problem}"
    return None


def agree(found: str | None, what: str, out: Path) -> None:
    """Raise on every rank when any rank found a mismatch."""
    problem = _first_mismatch(found)
    if problem is not None:
        raise UserError(f"{what}: verification failed: {problem}; the output stays incomplete "
                        f"in {out} (--no-verify skips the check)")
