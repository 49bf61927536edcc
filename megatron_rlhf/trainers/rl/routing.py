"""MoE routing replay in a PPO worker: which passes replay and record (``actor.router_replay``),
and the routers' own choices back on the batch's sample grid.

- ``none``: nothing replayed; the old pass records the trainer's own routing, which the driver
  compares with the engine's (``moe/routing_agreement``);
- ``R3``: the engine's routing (``Experience.routing``) is replayed in the old, reference and
  update passes; the old pass still records what the routers would choose themselves, and the
  experts it ran, which the driver compares with the engine's (``moe/replayed_agreement``: 1
  when the replay took effect, whatever the routers would have chosen);
- ``R2``: the old pass records; the driver puts its routing in ``Experience.routing``, which
  the update's epochs replay.
"""

from __future__ import annotations

import torch

from megatron_rlhf.data.packing import to_grid
from megatron_rlhf.errors import UserError
from megatron_rlhf.models.routing_replay import RoutingReplay, routing_agreement


def routing_replay(model, arch, groups, sequence_parallel: bool) -> RoutingReplay | None:
    """The driver of ``model``'s routers (one pipeline stage), or None for a dense model."""
    if arch.moe is None:
        return None
    layers = [i + 1 for i, moe in enumerate(arch.moe.layer_pattern) if moe]
    return RoutingReplay(model, layers, arch.moe.topk, groups.tp_rank, groups.layout.tp,
                         sequence_parallel)


def pass_mode(mode: str, batch: dict, which: str) -> tuple[bool, bool]:
    """(replay, record) for a pass: ``which`` is ``old``, ``ref`` or ``update``."""
    has = batch.get("routing") is not None
    if which == "update":
        return has and mode in ("R2", "R3"), False
    if which == "ref":
        return has and mode == "R3", False
    return has and mode == "R3", has or mode == "R2"


def own_routing(replay: RoutingReplay, groups, micro: list[dict], width: int,
                used: bool = False) -> torch.Tensor:
    """What the routers chose themselves in the pass just run (``used``: the experts it ran),
    ``[rows, width, L, K]``, the micro-batches' rows in turn. Collective over TP and PP."""
    per_micro = replay.recorded_micro_batches(groups.tp, groups.pp, used)
    if not per_micro:
        return torch.empty(0, width, replay.num_layers, replay.topk, dtype=torch.int16)
    parts = []
    for full, batch in zip(per_micro, micro):
        grid = to_grid(full, batch)  # [rows, t, L, K] on the micro-batch's sample grid
        parts.append(torch.nn.functional.pad(grid, (0, 0, 0, 0, 0, width - grid.shape[1]), value=-1))
    return torch.cat(parts).to(torch.int16)


def recorded_routing(batch: dict, own: torch.Tensor | None, mode: str,
                     used: torch.Tensor | None = None) -> dict[str, float]:
    """The old pass's own routing ``own [N, T, L, K]``: ``moe/routing_agreement`` with the
    engine's (``batch["routing"]``), and under R2 the routing the update replays; when it
    replayed, the experts it ran (``used``): ``moe/replayed_agreement`` with the engine's."""
    if own is None:
        return {}
    metrics = {}
    if batch.get("routing") is not None:
        metrics["moe/routing_agreement"] = routing_agreement(own, batch["routing"])[0]
        if used is not None:
            metrics["moe/replayed_agreement"] = routing_agreement(used, batch["routing"])[0]
    if mode == "R2":
        batch["routing"] = own
    return metrics


def check_routing_replay(mode: str, model_path: str, moe: bool, offline: bool, log) -> None:
    """``actor.router_replay`` refused for a dense policy; said once (``log``) when some samples
    will carry no engine routing (``offline`` data: their routers choose for themselves)."""
    if mode == "none":
        return
    if not moe:
        raise UserError(f"actor.router_replay={mode} replays mixture-of-experts routing; "
                        f"{model_path} is a dense model (set it to none)")
    if mode == "R3" and offline:
        log("actor.router_replay=R3: data.offline_files' samples have no engine routing "
            "to replay; the trainer's routers choose their experts themselves")
