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
    last token, in input order; ``num_tokens`` the sequences' tokens.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    last_index: torch.Tensor
    num_tokens: int
    position_ids: torch.Tensor | None = None  # [R, L] with shared prompts (pack_shared)
    computed_tokens: int = 0  # the real tokens in the rows (a shared prompt counted once)


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
    # Python lists, made tensors once (a torch call per sequence costs more than it moves)
    flat_tokens, flat_segments = [pad_id] * (len(rows) * width), [-1] * (len(rows) * width)
    last = [[0, 0] for _ in sequences]
    for row, members in enumerate(rows):
        offset = row * width
        for index in members:
            n = lengths[index]
            flat_tokens[offset:offset + n] = sequences[index]
            flat_segments[offset:offset + n] = [index] * n
            last[index] = [row, offset - row * width + n - 1]
            offset += n
    tokens = torch.tensor(flat_tokens, dtype=torch.long).view(len(rows), width)
    segments = torch.tensor(flat_segments, dtype=torch.long).view(len(rows), width)
    last_index = torch.tensor(last, dtype=torch.long).view(len(sequences), 2)
    mask = None
    if remove_padding:
        same = segments[:, :, None] == segments[:, None, :]
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        allowed = same & causal & (segments[:, :, None] >= 0)
        # Padding positions attend to themselves only: no row of the mask is empty, so fused
        # attention kernels never produce NaN there (their outputs are never read).
        allowed |= torch.eye(width, dtype=torch.bool) & (segments[:, :, None] < 0)
        mask = (~allowed).unsqueeze(1)
    return PackedBatch(tokens, mask, last_index, sum(lengths),
                       computed_tokens=sum(lengths) if remove_padding else tokens.numel())


def pack_shared(sequences: list[list[int]], groups: list[int], row_capacity: int,
                pad_id: int) -> PackedBatch:
    """:func:`pack_sequences` where the sequences of a group (the two sides of a preference
    pair) share their common start (:func:`prompt_units`), with ``position_ids``."""
    lengths = [len(s) for s in sequences]
    units, _ = prompt_units(sequences, groups, SHARED_ROW_FACTOR * row_capacity)
    owner, unit_of, segment, position, unpack_row, unpack_col = _place(
        units, lengths, row_capacity, max(lengths))
    width = max(lengths)
    grid = torch.tensor([list(seq) + [pad_id] * (width - len(seq)) for seq in sequences],
                        dtype=torch.long)
    valid = owner >= 0
    tokens = grid.flatten()[owner.clamp(min=0)].masked_fill(~valid, pad_id)
    last = torch.tensor(lengths) - 1
    index = torch.arange(len(sequences))
    last_index = torch.stack([unpack_row[index, last], unpack_col[index, last]], dim=1)
    return PackedBatch(tokens, _unit_mask(unit_of, segment), last_index, sum(lengths), position,
                       int(valid.sum()))


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


@dataclass
class Unit:
    """Samples laid out together: the first ``prefix`` tokens of ``members[0]`` (the same in
    every member), then each member's tokens from ``prefix`` on. ``prefix`` 0: one sample."""

    members: list[int]
    prefix: int = 0

    def tokens(self, lengths: list[int]) -> int:
        return self.prefix + sum(lengths[i] - self.prefix for i in self.members)


def prompt_units(tokens: list[list[int]], groups: list[int],
                 limit: int | None = None) -> tuple[list[Unit], int]:
    """Samples of one group (one prompt) that start with the same tokens share them: their
    longest common prefix but its last token, which each member keeps (the logits there predict
    each member's own next token). Exact whatever the tokens are: a prefix shorter than the
    prompt (a template that rendered it differently) shares less, a longer one (replies that
    start alike) more. A group whose unit would exceed ``limit`` tokens is split into units
    that do not (a packed row's mask is dense: its cost is the square of its length). Returns
    the units, in the order of their first member, and how many groups of two or more samples
    shared nothing."""
    members: dict[int, list[int]] = {}
    for index, group in enumerate(groups):
        members.setdefault(group, []).append(index)
    units, unshared = [], 0
    for indices in members.values():
        common = min(len(tokens[i]) for i in indices)
        first = tokens[indices[0]]
        for i in indices[1:]:
            other = tokens[i]
            common = next((t for t in range(common) if other[t] != first[t]), common)
        if len(indices) > 1 and common > 1:
            units += _split(indices, common - 1, [len(t) for t in tokens], limit)
        else:
            unshared += len(indices) > 1
            units += [Unit([i]) for i in indices]
    units.sort(key=lambda unit: unit.members[0])
    return units, unshared


def _split(indices: list[int], prefix: int, lengths: list[int], limit: int | None) -> list[Unit]:
    """``indices`` sharing ``prefix`` tokens, in units of at most ``limit`` tokens (a member
    alone is never split)."""
    units, part = [], []
    for i in indices:
        if part and limit is not None and Unit(part + [i], prefix).tokens(lengths) > limit:
            units.append(Unit(part, prefix) if len(part) > 1 else Unit(part))
            part = []
        part.append(i)
    units.append(Unit(part, prefix) if len(part) > 1 else Unit(part))
    return units


# A shared prompt's unit may fill a row of up to this many times the row capacity: with
# rollout.n replies, one prompt + response long each, it rarely fits one capacity.
SHARED_ROW_FACTOR = 4


def _place(units: list[Unit], lengths: list[int], capacity: int, width_grid: int):
    """Rows for ``units`` (first fit; a unit longer than ``capacity`` gets a row alone). Per
    packed position: the flat sample-grid index it holds (``owner``, -1: padding), its unit and
    segment (0: a shared prefix, j: the unit's j-th member) and its position in its sample; and
    per sample token, where it sits (``unpack_row``, ``unpack_col``). Built in Python lists and
    made tensors once: a micro-batch has hundreds of spans, and a torch call per span cost more
    than the reward model's own step on CPU."""
    sizes = [unit.tokens(lengths) for unit in units]
    rows = _assign_rows(sizes, max([capacity, *sizes]))
    width = max(sum(sizes[u] for u in row) for row in rows)
    cells = len(rows) * width
    owner, unit_of, segment, position = [-1] * cells, [-1] * cells, [0] * cells, [0] * cells
    unpack_row, unpack_col = [0] * (len(lengths) * width_grid), [0] * (len(lengths) * width_grid)

    def put(row: int, col: int, sample: int, start: int, stop: int, u: int, seg: int, members):
        at, n = row * width + col, stop - start
        owner[at:at + n] = range(sample * width_grid + start, sample * width_grid + stop)
        unit_of[at:at + n], segment[at:at + n] = [u] * n, [seg] * n
        position[at:at + n] = range(start, stop)
        for i in members:
            unpack_row[i * width_grid + start:i * width_grid + stop] = [row] * n
            unpack_col[i * width_grid + start:i * width_grid + stop] = range(col, col + n)

    for row, placed in enumerate(rows):
        col = 0
        for u in placed:
            unit = units[u]
            if unit.prefix:
                put(row, col, unit.members[0], 0, unit.prefix, u, 0, unit.members)
                col += unit.prefix
            for j, i in enumerate(unit.members, start=1):
                put(row, col, i, unit.prefix, lengths[i], u, j, (i,))
                col += lengths[i] - unit.prefix
    grid = lambda values, r, c: torch.tensor(values, dtype=torch.long).view(r, c)  # noqa: E731
    return (grid(owner, len(rows), width), grid(unit_of, len(rows), width),
            grid(segment, len(rows), width), grid(position, len(rows), width),
            grid(unpack_row, len(lengths), width_grid), grid(unpack_col, len(lengths), width_grid))


def _unit_mask(unit_of: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """``[R, 1, L, L]`` True = may not attend: within a unit, causally, a shared prefix is seen
    by every member and a member by itself only; padding sees itself only."""
    width = unit_of.shape[1]
    valid = unit_of >= 0
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    seen = (segment[:, None, :] == 0) | (segment[:, :, None] == segment[:, None, :])
    allowed = (unit_of[:, :, None] == unit_of[:, None, :]) & causal & valid[:, None, :] & seen
    # Padding positions attend to themselves only: no row of the mask is empty, so fused
    # attention kernels never produce NaN there (their outputs are never read).
    allowed |= torch.eye(width, dtype=torch.bool) & ~valid[:, :, None]
    return (~allowed).unsqueeze(1)


def pack_token_grid(batch: dict, capacity: int, pad_id: int = 0,
                    share_prompts: bool = False) -> dict:
    """Pack a right-padded micro-batch (``input_ids``, ``targets`` and per-token ``[n, T]``
    tensors, ``lengths [n, 1]``, with ``share_prompts`` ``group [n]``) into rows of at most
    ``capacity`` tokens.

    The model sees packed ``input_ids``/``targets [R, L]`` and the mask; every other per-token
    tensor stays on the sample grid under ``grid``, with ``unpack_row`` and ``unpack_col [n, T]``
    giving where token ``t`` of sample ``i`` sits in the packed rows, so per-token outputs map
    back with :func:`to_grid` (a shared prefix's outputs to every member: their gradients add
    up there, as over copies). ``grid`` is a nested dict so that :func:`pad_batch` (pipeline
    padding) leaves it alone. With ``share_prompts`` the samples of a group share their prompt
    (:func:`prompt_units`) and ``position_ids [R, L]`` give each token its position in its own
    sample (RoPE must see a reply continue from its prompt's end). ``packing`` counts the
    tokens computed, the samples' tokens and the groups that could share nothing.
    """
    lengths = batch["lengths"].reshape(-1).tolist()
    tokens = [batch["input_ids"][i, :n].tolist() for i, n in enumerate(lengths)]
    units, unshared = [Unit([i]) for i in range(len(lengths))], 0
    if share_prompts:
        units, unshared = prompt_units(tokens, batch["group"].tolist(),
                                       SHARED_ROW_FACTOR * capacity)
    owner, unit_of, segment, position, unpack_row, unpack_col = _place(
        units, lengths, capacity, batch["input_ids"].shape[1])
    valid = owner >= 0
    source = owner.clamp(min=0)

    def packed(grid: torch.Tensor, fill) -> torch.Tensor:
        out = grid.flatten(0, 1)[source]
        return out.masked_fill(~valid.view(*valid.shape, *[1] * (out.dim() - 2)), fill)

    grid = {k: v for k, v in batch.items()
            if torch.is_tensor(v) and v.dim() == 2 and k not in ("input_ids", "targets")}
    out = {"input_ids": packed(batch["input_ids"], pad_id),
           "attention_mask": _unit_mask(unit_of, segment),
           "targets": packed(batch["targets"], pad_id),
           "grid": {**grid, "unpack_row": unpack_row, "unpack_col": unpack_col},
           **{k: v for k, v in batch.items() if not torch.is_tensor(v)}}
    out["packing"] = {"computed": int(valid.sum()), "sample": sum(lengths),
                      "unshared_groups": unshared}
    if share_prompts:
        out["position_ids"] = position
    if "routing" in batch:  # MoE routing to replay, [n, T, L, K]: it follows the tokens (a
        # shared prefix's, its first member's: the group's prompt routed once)
        out["routing"] = packed(batch["routing"], -1)
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
