"""Sequence packing: several sequences share one row, separated by a block-diagonal causal mask.

Packing removes the compute that padding to the longest sequence costs in every projection and
MLP. RoPE needs no per-sequence position reset: attention depends only on relative positions,
which a constant offset inside a row does not change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedBatch:
    """Rows of tokens and where each input sequence ended up.

    ``input_ids [R, L]``; ``attention_mask [R, 1, L, L]`` bool, True = may not attend (None means
    plain causal, one sequence per row); ``last_index [N, 2]`` (row, position) of each sequence's
    last token, in input order; ``num_tokens`` real (non-padding) tokens.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    last_index: torch.Tensor
    num_tokens: int


def _assign_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit in input order (deterministic): row -> sequence indices."""
    rows, free = [], []
    for index, length in enumerate(lengths):
        for row, room in enumerate(free):
            if length <= room:
                rows[row].append(index)
                free[row] -= length
                break
        else:
            rows.append([index])
            free.append(capacity - length)
    return rows


def pack_sequences(sequences: list[list[int]], row_capacity: int, pad_id: int,
                   remove_padding: bool = True) -> PackedBatch:
    """Pack (``remove_padding``) or right-pad (one per row) ``sequences`` into a batch."""
    lengths = [len(s) for s in sequences]
    if max(lengths) > row_capacity:
        raise ValueError(f"a sequence of {max(lengths)} tokens exceeds the row capacity {row_capacity}")
    rows = _assign_rows(lengths, row_capacity) if remove_padding else [[i] for i in range(len(lengths))]
    width = max(sum(lengths[i] for i in row) for row in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    segments = torch.full((len(rows), width), -1, dtype=torch.long)
    last_index = torch.zeros(len(sequences), 2, dtype=torch.long)
    for row, members in enumerate(rows):
        offset = 0
        for index in members:
            n = lengths[index]
            tokens[row, offset:offset + n] = torch.tensor(sequences[index], dtype=torch.long)
            segments[row, offset:offset + n] = index
            last_index[index] = torch.tensor([row, offset + n - 1])
            offset += n
    mask = None
    if remove_padding:
        same = segments[:, :, None] == segments[:, None, :]
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        allowed = same & causal & (segments[:, :, None] >= 0)
        # Padding positions attend to themselves only: no row of the mask is empty, so fused
        # attention kernels never produce NaN there (their outputs are never read).
        allowed |= torch.eye(width, dtype=torch.bool) & (segments[:, :, None] < 0)
        mask = (~allowed).unsqueeze(1)
    return PackedBatch(tokens, mask, last_index, sum(lengths))


def pad_batch(batch: dict, rows: int, length: int, pad_id: int = 0) -> dict:
    """Grow ``input_ids [R, L]`` (and ``attention_mask``) to ``[rows, length]``.

    Pipeline stages exchange fixed-shape activations, so every micro-batch of a schedule gets one
    shape. New positions are padding: fully masked when a mask exists, after the real tokens of a
    causal row otherwise, so no real token's output changes.
    """
    tokens = batch["input_ids"]
    extra_rows, extra_cols = rows - tokens.shape[0], length - tokens.shape[1]
    if not extra_rows and not extra_cols:
        return batch
    padded = dict(batch, real_shape=tuple(tokens.shape))
    padded["input_ids"] = torch.nn.functional.pad(tokens, (0, extra_cols, 0, extra_rows), value=pad_id)
    for key, value in batch.items():  # per-token tensors (targets, masks) follow the tokens
        if key != "input_ids" and torch.is_tensor(value) and value.shape == tokens.shape:
            padded[key] = torch.nn.functional.pad(value, (0, extra_cols, 0, extra_rows))
    mask = batch.get("attention_mask")
    if mask is not None:
        mask = torch.nn.functional.pad(mask, (0, extra_cols, 0, extra_cols, 0, 0, 0, extra_rows),
                                       value=True)
        new = torch.ones(rows, 1, length, dtype=torch.bool)
        new[: tokens.shape[0], :, : tokens.shape[1]] = False
        # New padding positions attend to themselves only (see pack_sequences).
        mask &= ~(torch.eye(length, dtype=torch.bool) & new.unsqueeze(-1))
        padded["attention_mask"] = mask
    return padded


def pad_to_common_shape(batches: list[dict], pad_id: int = 0) -> list[dict]:
    rows = max(b["input_ids"].shape[0] for b in batches)
    length = max(b["input_ids"].shape[1] for b in batches)
    return [pad_batch(b, rows, length, pad_id) for b in batches]


def pack_token_grid(batch: dict, capacity: int, pad_id: int = 0) -> dict:
    """Pack a right-padded micro-batch (``input_ids``, ``targets`` and per-token ``[n, T]``
    tensors, ``lengths [n, 1]``) into rows of at most ``capacity`` tokens.

    The model sees packed ``input_ids``/``targets [R, L]`` and the block-diagonal mask; every
    other per-token tensor stays on the sample grid under ``grid``, with ``unpack_row`` and
    ``unpack_col [n, T]`` giving where token ``t`` of sample ``i`` sits in the packed rows, so
    per-token outputs map back with :func:`to_grid`. ``grid`` is a nested dict so that
    :func:`pad_batch` (pipeline padding) leaves it alone.
    """
    lengths = batch["lengths"].reshape(-1).tolist()
    tokens = [batch["input_ids"][i, :n].tolist() for i, n in enumerate(lengths)]
    packed = pack_sequences(tokens, capacity, pad_id)
    count, width = batch["input_ids"].shape
    positions = torch.arange(width)
    valid = positions[None, :] < torch.tensor(lengths)[:, None]
    start = packed.last_index[:, 1] - torch.tensor(lengths) + 1
    unpack_col = torch.where(valid, start[:, None] + positions[None, :], 0)
    unpack_row = packed.last_index[:, :1].expand(count, width).clone()
    targets = torch.full_like(packed.input_ids, pad_id)
    targets[unpack_row[valid], unpack_col[valid]] = batch["targets"][valid]
    grid = {k: v for k, v in batch.items()
            if torch.is_tensor(v) and v.dim() == 2 and k not in ("input_ids", "targets")}
    out = {"input_ids": packed.input_ids, "attention_mask": packed.attention_mask,
           "targets": targets, "grid": {**grid, "unpack_row": unpack_row, "unpack_col": unpack_col},
           **{k: v for k, v in batch.items() if not torch.is_tensor(v)}}
    if "routing" in batch:  # MoE routing to replay, [n, T, L, K]: it follows the tokens
        routing = batch["routing"]
        packed_routing = torch.full((*packed.input_ids.shape, *routing.shape[2:]), -1,
                                    dtype=routing.dtype)
        packed_routing[unpack_row[valid], unpack_col[valid]] = routing[valid]
        out["routing"] = packed_routing
    return out


def to_grid(per_token: torch.Tensor, batch: dict) -> torch.Tensor:
    """A model output per position (``[R, L, ...]``) on the sample grid ``[n, T, ...]``: packed
    batches are unpacked; padded ones are cut to their own rows and width."""
    grid = batch.get("grid")
    if grid is None:
        rows, width = batch.get("real_shape", batch["input_ids"].shape)
        return per_token[:rows, :width]
    return per_token[grid["unpack_row"], grid["unpack_col"]]


def grid_tensor(batch: dict, key: str) -> torch.Tensor:
    """Per-token input ``key`` on the sample grid (see :func:`to_grid`)."""
    grid = batch.get("grid")
    return to_grid(batch[key], batch) if grid is None else grid[key]
