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

from dataclasses import dataclass

from megatron_rlhf.config.parallel import check_engine_layout
from megatron_rlhf.errors import UserError


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
