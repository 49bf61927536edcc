"""Which worker ranks run the processes of rollout engines that span several GPUs or nodes, and
which GPUs each such process is given.

An engine of ``tp`` GPUs covers either a slice of one node's GPUs (``tp`` divides the GPUs of a
node) or whole nodes (``tp`` a multiple of them), never parts of two nodes: SGLang runs one
process per node of an engine (``nnodes``, ``node_rank``, ``dist_init_addr``), each driving that
node's GPUs of the engine. Engines are laid over the ranks in (node, GPU) order; the process of
an engine on a node is run by the rank holding the lowest of those GPUs, and must see all of
them (its GPUs are the engine's TP ranks on that node).

The same layout serves engines colocated with the trainers (the ranks are the trainers') and
engines on GPUs of their own (the ranks of a separate rollout pool).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from megatron_rlhf.errors import UserError


def check_engine_layout(tp: int, gpus_per_node: int, nnodes: int, what: str = "rollout.tp") -> None:
    """One line naming what is wrong with rollout engines of ``tp`` GPUs on ``nnodes`` nodes of
    ``gpus_per_node`` GPUs: an engine covers a slice of one node or whole nodes (SGLang runs one
    process per node of an engine), and fits the job."""
    total = gpus_per_node * nnodes
    if tp > total:
        raise UserError(f"config: {what}={tp}: an engine larger than the job's {total} GPUs "
                        f"({nnodes} node(s) x {gpus_per_node})")
    if tp <= gpus_per_node and gpus_per_node % tp:
        raise UserError(f"config: {what}={tp} does not divide the {gpus_per_node} GPUs of a node "
                        "(an engine would straddle two nodes)")
    if tp > gpus_per_node and tp % gpus_per_node:
        raise UserError(f"config: {what}={tp} spans nodes but is not a whole number of nodes of "
                        f"{gpus_per_node} GPUs")


@dataclass(frozen=True)
class Place:
    """Where a rank runs: its node (an address or id) and its GPU's index on that node."""

    rank: int
    node: str
    gpu: int


@dataclass(frozen=True)
class EngineProcess:
    engine: int  # which engine
    node_rank: int  # SGLang's node_rank: this process's node among the engine's nodes
    nnodes: int  # nodes the engine spans
    rank: int  # the worker rank that runs this process
    node: str
    gpus: tuple[int, ...]  # the node's GPUs it drives (it must see all of them)
    members: tuple[int, ...]  # the worker ranks on those GPUs (this one first)


def engine_processes(places: list[Place], tp: int) -> list[EngineProcess]:
    """The engine processes of engines of ``tp`` GPUs over ranks placed at ``places``."""
    by_node: dict[str, list[Place]] = {}
    for place in sorted(places, key=lambda p: (p.node, p.gpu)):
        by_node.setdefault(place.node, []).append(place)
    counts = {len(ranks) for ranks in by_node.values()}
    if len(counts) != 1:
        raise UserError("engine placement: the nodes hold different numbers of ranks "
                        f"({ {node: len(r) for node, r in by_node.items()} })")
    per_node = counts.pop()
    check_engine_layout(tp, per_node, len(by_node))
    for node, ranks in by_node.items():
        gpus = [p.gpu for p in ranks]
        if len(set(gpus)) != len(gpus):
            raise UserError(f"engine placement: two ranks on node {node} share a GPU ({gpus})")
    slots = [p for node in sorted(by_node) for p in by_node[node]]  # (node, GPU) order
    processes = []
    for engine, start in enumerate(range(0, len(slots), tp)):
        mine = slots[start:start + tp]
        nodes = sorted({p.node for p in mine}, key=lambda n: sorted(by_node).index(n))
        for node_rank, node in enumerate(nodes):
            here = [p for p in mine if p.node == node]
            processes.append(EngineProcess(engine, node_rank, len(nodes), here[0].rank, node,
                                           tuple(p.gpu for p in here),
                                           tuple(p.rank for p in here)))
    return processes


@dataclass(frozen=True)
class EngineSlot:
    """This rank's part in the rollout engines: which engine it belongs to, the engine's ranks,
    and the engine process it runs (None on the other GPUs of a node)."""

    index: int  # which engine: the generator data-parallel rank
    count: int  # engines in the group: the generator data-parallel size
    members: tuple[int, ...]  # every worker rank on the engine's GPUs, node by node
    head: int  # the rank running the engine's first process: it reports the engine's samples
    process: EngineProcess | None
    processes: tuple[EngineProcess, ...]  # the engine's processes, node_rank order

    @property
    def tp(self) -> int:
        return len(self.members)


def engine_slots(places: list[Place], tp: int) -> dict[int, EngineSlot]:
    """Every rank's :class:`EngineSlot` for engines of ``tp`` GPUs over ranks at ``places``."""
    processes = engine_processes(places, tp)
    count = processes[-1].engine + 1
    slots = {}
    for engine in range(count):
        mine = tuple(p for p in processes if p.engine == engine)
        members = tuple(r for p in mine for r in p.members)
        for proc in mine:
            for rank in proc.members:
                slots[rank] = EngineSlot(engine, count, members, mine[0].rank,
                                         proc if rank == proc.rank else None, mine)
    return slots


def this_place() -> tuple[str, int | None]:
    """(node, GPU index on it or None) of this process, from what its launcher set: the Ray
    worker group (``MRLHF_NODE``/``MRLHF_GPU``), Slurm (``SLURMD_NODENAME``, ``SLURM_LOCALID``),
    torchrun (``GROUP_RANK``, ``LOCAL_RANK``), else the host name."""
    import socket

    env = os.environ
    if "MRLHF_NODE" in env:
        gpu = env.get("MRLHF_GPU")
        return env["MRLHF_NODE"], int(gpu) if gpu else None
    if "SLURMD_NODENAME" in env and "SLURM_LOCALID" in env:
        return env["SLURMD_NODENAME"], int(env["SLURM_LOCALID"])
    if "GROUP_RANK" in env and "LOCAL_RANK" in env:
        return f"torchrun-node{env['GROUP_RANK']}", int(env["LOCAL_RANK"])
    return socket.gethostname(), None


def rank_places(group=None) -> list[Place]:
    """Every rank's :class:`Place` (collective over ``group``). A rank that knows no GPU index
    takes its node's next free slot in rank order."""
    import torch.distributed as dist

    found: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, this_place(), group=group)
    taken: dict[str, set[int]] = {}
    for node, gpu in found:
        if gpu is not None:
            taken.setdefault(node, set()).add(gpu)
    places = []
    for rank, (node, gpu) in enumerate(found):
        if gpu is None:
            gpu = next(g for g in range(len(found)) if g not in taken.setdefault(node, set()))
            taken[node].add(gpu)
        places.append(Place(rank, node, gpu))
    return places


def engine_grid(slot: EngineSlot) -> list[tuple[int, ...]]:
    """Every engine's member ranks, engine by engine (collective)."""
    import torch.distributed as dist

    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (slot.index, slot.members))
    return [members for _, members in sorted(set(rows))]


def engine_groups(slot: EngineSlot, backend: str = "gloo"):
    """The process group of this rank's engine (collective: every rank makes every engine's
    group, in engine order, as ``new_group`` requires)."""
    import torch.distributed as dist

    mine = None
    for index, members in enumerate(engine_grid(slot)):
        group = dist.new_group(sorted(members), backend=backend)
        if index == slot.index:
            mine = group
    return mine


def engine_addresses(slot: EngineSlot) -> str:
    """``host:port`` where the processes of this rank's engine meet (its first process's host, a
    port free there): SGLang's ``dist_init_addr`` (collective)."""
    import socket

    import torch.distributed as dist

    from megatron_rlhf.distributed.launch import free_port

    mine = None
    if dist.get_rank() == slot.head:
        host = os.environ.get("MRLHF_NODE_IP") or socket.gethostbyname(socket.gethostname())
        mine = f"{host}:{free_port()}"
    found: list = [None] * dist.get_world_size()
    dist.all_gather_object(found, (slot.index, mine))
    return next(addr for index, addr in found if index == slot.index and addr)
