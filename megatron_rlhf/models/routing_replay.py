"""MoE routing replay (R2, R3) on megatron-core's own ``RouterReplay``.

A model built with ``moe_enable_routing_replay`` gives each of its routers a ``RouterReplay``;
:class:`RoutingReplay` drives the instances of one model's routers (megatron keeps every model's
instances in one process-global list, so its static helpers would also drive the reference's).
Per micro-batch it

- sets each router's target top-k experts from the micro-batch's ``routing [b, t, L, K]``
  (token ``t`` of row ``b``, MoE layer ``L`` of the whole model, ``K`` expert ids): a router sees
  its tokens sequence-major (``s * b_size + b``) and, under sequence parallelism, only its TP
  rank's slice of the sequence; each pipeline stage replays its own layers;
- records the top-k the router itself would choose (for ``moe/routing_agreement``, and R2's
  recorded routing), also while replaying: megatron computes no top-k of its own then; and the
  top-k megatron's router actually ran with (``moe/replayed_agreement``: under R3 the engine's,
  whatever the router would have chosen).

The router's probabilities are always the live scores gathered at the chosen experts, so the
router keeps its gradient. Activation recompute re-runs a router inside backward; megatron
replays from a queue there (``REPLAY_BACKWARD``), which the forward pre-hook selects.
"""

from __future__ import annotations

import torch

UNKNOWN = -1
"""A position of ``routing`` with no recorded routing (padding, a sequence's last token)."""


def replay_targets(routing: torch.Tensor, layer: int, sp_rank: int, sp_size: int) -> torch.Tensor:
    """``routing [b, t, L, K]`` -> one router's targets ``[tokens, K]`` for MoE layer ``layer``, in
    the router's token order (sequence-major; this rank's sequence slice under sequence
    parallelism); -1 stays where nothing was recorded (the router then chooses itself)."""
    part = routing[:, :, layer, :].transpose(0, 1)  # [t, b, K]
    if sp_size > 1:
        part = part.chunk(sp_size, dim=0)[sp_rank]
    return part.reshape(-1, part.shape[-1]).long()


def routing_agreement(own: torch.Tensor, engine: torch.Tensor) -> tuple[float, int]:
    """(fraction, count) of (token, MoE layer) pairs where both are known whose top-k expert
    *sets* agree; ``own``, ``engine`` ``[N, T, L, K]`` integer, ``-1`` unknown."""
    known = (own >= 0).all(-1) & (engine >= 0).all(-1)
    same = (own.sort(-1).values == engine.sort(-1).values).all(-1)
    count = int(known.sum())
    return (float((same & known).sum()) / count if count else float("nan")), count


class RoutingReplay:
    """The routers of one model (one pipeline stage of it)."""

    def __init__(self, model, moe_layers: list[int], topk: int, tp_rank: int, tp_size: int,
                 sequence_parallel: bool):
        """``moe_layers``: every MoE layer number of the whole model (megatron's global,
        1-based ``layer_number``); the model holds some of them (a pipeline stage)."""
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        if any(r.router_replay is None for r in self.routers):
            raise ValueError("routing replay: the model was built without moe_enable_routing_replay")
        index = {number: i for i, number in enumerate(sorted(moe_layers))}
        self.layers = [index[r.layer_number] for r in self.routers]
        self.num_layers, self.topk = len(moe_layers), topk
        self.sp_rank, self.sp_size = (tp_rank, tp_size) if sequence_parallel else (0, 1)
        self.replaying = False
        self.recording = False
        # While replaying, per (token, router) with a known target: targets, forwards that ran
        # exactly the target experts, routers whose own choice was the target (take_counts()).
        self.counts = [0, 0, 0]
        self.recorded: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self.used: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self.shapes: list[tuple[int, int]] = []  # (rows, positions) of each recorded forward
        self._hooks = [r.register_forward_pre_hook(self._select_action) for r in self.routers]
        for slot, router in enumerate(self.routers):
            _record_own_topk(router.router_replay, self, slot)

    def _select_action(self, _router, _args) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        replay = _router.router_replay
        if not self.replaying:
            replay.clear_router_replay_action()
        elif torch._C._current_graph_task_id() != -1:  # recomputed inside backward
            replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        else:
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def before_forward(self, batch: dict, rows: int, positions: int) -> None:
        """Called by the model's forward with the micro-batch and the shape the model runs at
        (pipeline and sequence-parallel padding included)."""
        if self.recording:
            self.shapes.append((rows, positions))
        if not self.replaying:
            return
        routing = batch.get("routing")
        if routing is None:
            raise ValueError("routing replay: a micro-batch without routing")
        pad_rows, pad_len = rows - routing.shape[0], positions - routing.shape[1]
        if pad_rows or pad_len:
            routing = torch.nn.functional.pad(routing, (0, 0, 0, 0, 0, pad_len, 0, pad_rows),
                                              value=UNKNOWN)
        for router, layer in zip(self.routers, self.layers):
            router.router_replay.set_target_indices(
                replay_targets(routing, layer, self.sp_rank, self.sp_size))

    def start(self, replay: bool, record: bool) -> None:
        for router in self.routers:
            router.router_replay.clear_indices()
        self.replaying, self.recording = replay, record
        self.recorded = [[] for _ in self.routers]
        self.used = [[] for _ in self.routers]
        self.shapes = []

    def stop(self) -> None:
        self.replaying = self.recording = False
        for router in self.routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()

    def take_counts(self) -> tuple[int, int, int]:
        """(targets, run as targeted, chosen as targeted) since the last call, this rank's
        routers, forward passes (recompute inside backward not counted)."""
        counts, self.counts = tuple(self.counts), [0, 0, 0]
        return counts

    def count(self, asked: torch.Tensor, own: torch.Tensor, used: torch.Tensor) -> None:
        asked = asked.to(own.device)
        known = (asked >= 0).all(-1)
        target = asked.sort(-1).values
        for index, ids in ((1, used), (2, own)):
            same = (ids.to(own.device).sort(-1).values == target).all(-1) & known
            self.counts[index] += int(same.sum())
        self.counts[0] += int(known.sum())

    def recorded_micro_batches(self, tp_group, pp_group, used: bool = False) -> list[torch.Tensor]:
        """What the routers chose on their own in each recorded forward (``used``: the experts
        the forward ran), ``[rows, positions, L, K]`` over every MoE layer and the whole sequence
        (gathered over TP and PP; -1 nowhere once gathered). Collective over TP and PP."""
        import torch.distributed as dist

        recorded = self.used if used else self.recorded
        out = []
        for index, (rows, positions) in enumerate(self.shapes):
            full = torch.full((rows, positions, self.num_layers, self.topk), UNKNOWN,
                              dtype=torch.long)
            for slot, layer in enumerate(self.layers):
                own = recorded[slot][index].detach().cpu().long()  # [s_local * rows, K]
                s_local = own.shape[0] // rows
                start = self.sp_rank * s_local
                full[:, start:start + s_local, layer] = own.view(s_local, rows, -1).transpose(0, 1)
            from megatron_rlhf.distributed.platform import device

            full = full.to(device())
            for group in (tp_group, pp_group):
                if group is not None and dist.get_world_size(group) > 1:
                    dist.all_reduce(full, op=dist.ReduceOp.MAX, group=group)
            out.append(full.cpu())
        return out


def _record_own_topk(replay, driver: RoutingReplay, slot: int) -> None:
    """Wrap this one ``RouterReplay`` instance's top-k: it keeps the router's own choice when
    recording (forward passes, not a recompute inside backward), and positions of the replay
    target marked -1 (nothing recorded: padding, a sequence's last token, an offline sample)
    take the router's own choice before megatron replays the target."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    original = replay.get_replay_topk

    def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        forward = torch._C._current_graph_task_id() == -1
        action = replay.router_replay_action
        # A forward asked to replay: what it runs is checked against what was asked, whatever
        # megatron's replay action says (so a replay that never reaches the router shows).
        watched = driver.replaying and forward and replay.target_topk_idx is not None
        asked = replay.target_topk_idx if watched else None
        if (driver.recording and forward) or watched or action in (
                RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD):
            with torch.no_grad():
                own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)[1]
            if driver.recording and forward:
                driver.recorded[slot].append(own)
            if action == RouterReplayAction.REPLAY_FORWARD:
                replay.target_topk_idx = _known_or(replay.target_topk_idx, own)
            elif action == RouterReplayAction.REPLAY_BACKWARD:
                replay.replay_backward_list[0] = _known_or(replay.replay_backward_list[0], own)
        result = original(scores, topk, num_groups, group_topk, default_compute_topk)
        if driver.recording and forward:
            driver.used[slot].append(result[1].detach())
        if asked is not None:
            driver.count(asked, own, result[1])
        return result

    replay.get_replay_topk = get_replay_topk


def _known_or(target: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    target = target.to(own.device)
    if target.shape != own.shape:
        raise ValueError(f"routing replay: {tuple(target.shape)} target experts for a router "
                         f"that sees {tuple(own.shape)}")
    return torch.where(target < 0, own, target)
