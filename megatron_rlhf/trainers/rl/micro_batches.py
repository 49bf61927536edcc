"""How a PPO worker cuts a batch: each data-parallel rank's rows, micro-batches of a sample count
or a token budget (packed, shared prompts counted once), the update's group-major shuffle, and
the rows of results put back in order. Pure tensor code."""

from __future__ import annotations

import torch

from megatron_rlhf.data.packing import pack_token_grid, prompt_units


def dp_slice(count: int, dp: int, rank: int) -> slice:
    """Rank ``rank``'s contiguous share of ``count`` rows (shares differ by at most one)."""
    return slice(rank * count // dp, (rank + 1) * count // dp)


def micro_batches(batch: dict, rows: list[int], size: int, extra: dict | None = None,
                  pack_capacity: int = 0, share_prompts: bool = False) -> list[dict]:
    """Micro-batches of ``size`` rows of ``batch``, each cut to its longest sequence, or packed
    into rows of ``pack_capacity`` tokens when that is set (``share_prompts``: the samples of a
    group share their prompt, :func:`~megatron_rlhf.data.packing.prompt_units`)."""
    out = []
    for start in range(0, len(rows), size):
        index = torch.tensor(rows[start:start + size])
        length = int(batch["lengths"][index].max())
        micro = {k: v[index, :length] for k, v in batch.items() if torch.is_tensor(v) and v.dim() == 2}
        if "routing" in batch:  # MoE routing to replay: [N, T, L, K]
            micro["routing"] = batch["routing"][index, :length]
        if share_prompts:
            micro["group"] = batch["group"][index]
        micro |= extra or {}
        # A multi-turn sample may outgrow one prompt + one response: it then gets a row alone.
        out.append(pack_token_grid(micro, max(pack_capacity, length), share_prompts=share_prompts)
                   if pack_capacity else micro)
    return out


def token_counts(micro: dict) -> tuple[int, int, int]:
    """(tokens the model runs, the samples' own tokens, groups that shared nothing) of one
    micro-batch: packed rows count their real tokens (a shared prompt once), padded ones every
    position."""
    if "packing" in micro:
        p = micro["packing"]
        return p["computed"], p["sample"], p["unshared_groups"]
    return micro["input_ids"].numel(), int(micro["lengths"].sum()), 0


def in_row_order(result: torch.Tensor, mine: list[int], order: list[int]) -> torch.Tensor:
    """``result``'s rows (``order``: the rows the micro-batches held, in turn) put back in
    ``mine``'s order."""
    position = {row: index for index, row in enumerate(mine)}
    unsorted = torch.empty_like(result)
    unsorted[torch.tensor([position[row] for row in order])] = result
    return unsorted


def token_groups(lengths: torch.Tensor, rows: list[int], budget: int) -> list[list[int]]:
    """``rows`` in micro-batches of at most ``budget`` tokens (``lengths [N, 1]``), first-fit
    over rows sorted longest first (ties in row order, so every rank of a pipeline agrees); a row
    longer than ``budget`` gets a micro-batch alone."""
    return _first_fit([([r], int(lengths[r])) for r in rows], budget)


def _first_fit(items: list[tuple[list[int], int]], budget: int) -> list[list[int]]:
    """Items (rows, tokens) into micro-batches of at most ``budget`` tokens, longest first."""
    groups, room = [], []
    for rows, size in sorted(items, key=lambda item: (-item[1], item[0][0])):
        for index, free in enumerate(room):
            if size <= free:
                groups[index] += rows
                room[index] -= size
                break
        else:
            groups.append(list(rows))
            room.append(budget - size)
    return groups


def shared_token_groups(batch: dict, rows: list[int], budget: int) -> list[list[int]]:
    """:func:`token_groups` counting each shared prompt once: the samples of a group
    (:func:`~megatron_rlhf.data.packing.prompt_units`) stay together while they fit ``budget``
    with their prompt once; a larger group is split into parts that do."""
    lengths = batch["lengths"][:, 0]
    tokens = [batch["input_ids"][r, :int(lengths[r])].tolist() for r in rows]
    units, _ = prompt_units(tokens, batch["group"][torch.tensor(rows)].tolist())
    items = []
    for unit in units:
        part, size = [], unit.prefix
        for member in unit.members:
            cost = len(tokens[member]) - unit.prefix
            if part and size + cost > budget:
                items.append(([rows[m] for m in part], size))
                part, size = [], unit.prefix
            part.append(member)
            size += cost
        items.append(([rows[m] for m in part], size))
    return _first_fit(items, budget)


def group_major_order(groups: torch.Tensor, generator: torch.Generator) -> list[int]:
    """A shuffle of the samples that keeps each group (prompt) together: the groups in random
    order, each group's samples in row order (mini- and micro-batches then share prompts)."""
    order = torch.randperm(int(groups.max()) + 1, generator=generator).tolist()
    rank = {g: i for i, g in enumerate(order)}
    return sorted(range(len(groups)), key=lambda row: (rank[int(groups[row])], row))
