"""Rollout engines spanning GPUs and nodes: which worker ranks run each engine process and which
GPUs each is given, for colocated and separate placement, on one node and two; bad layouts are
one line. The Ray cases run on CPU with declared GPUs (Ray hands out GPU ids all the same)."""

import random

import pytest

from megatron_rlhf.distributed.engine_placement import check_engine_layout
from megatron_rlhf.errors import UserError
from megatron_rlhf.distributed.engine_placement import EngineProcess, Place, engine_processes


def grid(nodes: int, gpus: int) -> list[Place]:
    return [Place(n * gpus + g, f"node{n}", g) for n in range(nodes) for g in range(gpus)]


def test_engines_within_one_node():
    procs = engine_processes(grid(1, 8), tp=4)
    assert procs == [EngineProcess(0, 0, 1, 0, "node0", (0, 1, 2, 3), (0, 1, 2, 3)),
                     EngineProcess(1, 0, 1, 4, "node0", (4, 5, 6, 7), (4, 5, 6, 7))]
    assert [p.gpus for p in engine_processes(grid(2, 8), tp=1)] == [(g,) for g in range(8)] * 2


def test_an_engine_over_two_nodes_has_one_process_a_node():
    procs = engine_processes(grid(2, 4), tp=8)
    assert [(p.engine, p.node_rank, p.nnodes, p.rank, p.node, p.gpus) for p in procs] == [
        (0, 0, 2, 0, "node0", (0, 1, 2, 3)), (0, 1, 2, 4, "node1", (0, 1, 2, 3))]
    # 4 nodes, engines of 2 nodes each: 2 engines, node ranks restart per engine
    procs = engine_processes(grid(4, 8), tp=16)
    assert [(p.engine, p.node_rank, p.node) for p in procs] == [
        (0, 0, "node0"), (0, 1, "node1"), (1, 0, "node2"), (1, 1, "node3")]


def test_ranks_out_of_gpu_order_still_give_each_engine_its_gpus():
    places = grid(2, 4)
    ranks = list(range(8))
    random.Random(0).shuffle(ranks)
    shuffled = [Place(r, p.node, p.gpu) for r, p in zip(ranks, places)]
    procs = engine_processes(shuffled, tp=2)
    by_gpu = {(p.node, p.gpu): p.rank for p in shuffled}
    for proc in procs:
        assert proc.members == tuple(by_gpu[(proc.node, g)] for g in proc.gpus)
        assert proc.rank == proc.members[0] and proc.gpus in ((0, 1), (2, 3))


@pytest.mark.parametrize("tp, gpus, nodes, message", [
    (3, 8, 1, "rollout.tp=3 does not divide the 8 GPUs of a node"),
    (16, 8, 1, "rollout.tp=16: an engine larger than the job's 8 GPUs (1 node(s) x 8)"),
    (12, 8, 2, "rollout.tp=12 spans nodes but is not a whole number of nodes of 8 GPUs"),
])
def test_bad_engine_layouts_are_one_line(tp, gpus, nodes, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_engine_layout(tp, gpus, nodes)
    with pytest.raises(UserError, match=message.split(":")[0]):
        engine_processes(grid(nodes, gpus), tp)


@pytest.fixture(scope="module")
def two_nodes():
    """A Ray cluster of two nodes with 2 declared GPUs each (two raylets on this machine)."""
    import ray  # a dependency of the package: never skipped
    from ray.cluster_utils import Cluster

    cluster = Cluster()
    for _ in range(2):
        cluster.add_node(num_cpus=2, num_gpus=2, object_store_memory=80 * 2 ** 20)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def _group(name, size, pool=None, share=1):
    from megatron_rlhf.orchestration.worker_group import WorkerGroup

    return WorkerGroup(name, size, use_gpu=True, pool=pool, share=share)


def test_separate_engines_get_gpus_of_their_own(two_nodes):
    """Trainers on one node, the rollout pool on the other: its engines use only its GPUs."""
    trainers = _group("actor", 2)
    rollout = _group("rollout", 2)
    try:
        train_nodes = {p.node for p in trainers.places()}
        places = rollout.places()
        assert len(train_nodes) == 1 and {p.node for p in places}.isdisjoint(train_nodes)
        procs = engine_processes(places, tp=2)
        assert [p.gpus for p in procs] == [(0, 1)]
        assert {p.node for p in procs} == {p.node for p in places}
        assert [p.gpus for p in engine_processes(places, tp=1)] == [(0,), (1,)]
    finally:
        rollout.shutdown()
        trainers.shutdown()


def _check_colocated(places):
    """Engines laid over the trainers' GPUs of two nodes (two ranks a node)."""
    assert len({p.node for p in places}) == 2
    assert sorted((p.node, p.gpu) for p in places) == sorted(
        (node, g) for node in {p.node for p in places} for g in range(2))
    spanning = engine_processes(places, tp=4)  # one engine over both nodes
    assert [(p.node_rank, p.nnodes, p.gpus) for p in spanning] == [
        (0, 2, (0, 1)), (1, 2, (0, 1))]
    assert spanning[0].node != spanning[1].node
    per_node = engine_processes(places, tp=2)  # one engine a node
    assert [p.nnodes for p in per_node] == [1, 1] and {p.node for p in per_node} == {
        p.node for p in places}
    # every engine process is a rank on that node holding the lowest of its GPUs
    for proc in per_node + spanning:
        mine = places[proc.rank]
        assert mine.node == proc.node and mine.gpu == min(proc.gpus)


def test_colocated_engine_ranks_see_their_nodes_gpus_and_agree_on_the_placement(two_nodes):
    """An engine of 4 over both nodes: its ranks (Ray showing each the node's GPUs) find the
    same places as the driver, one engine group of all 4, the head on node rank 0's lowest GPU;
    without ``node_gpus`` Ray shows each rank its own GPU only."""
    from tests.orchestration_helpers import Placed

    from megatron_rlhf.orchestration.worker_group import WorkerGroup

    group = WorkerGroup("engine", 4, use_gpu=True, node_gpus=True)
    try:
        group.build(Placed)
        seen = group.call(Placed.seen, 4)
        driver = group.places()
        nodes = {p.node for p in driver}
        _check_colocated(driver)
        for rank, s in enumerate(seen):
            assert [(p.node, p.gpu) for p in s["places"]] == [(p.node, p.gpu) for p in driver]
            assert s["visible"] is None  # every GPU of the node (Ray set no mask)
            assert s["local_rank"] == driver[rank].gpu  # its own GPU, as a device index
            slot = s["slot"]
            assert (slot.index, slot.count, slot.tp, s["members_sum"]) == (0, 1, 4, 6)
            assert [(p.nnodes, p.node_rank) for p in slot.processes] == [(2, 0), (2, 1)]
            assert (slot.process is not None) == (driver[rank].gpu == 0)
        head = driver[seen[0]["slot"].head]
        assert head.gpu == 0 and head.node == seen[0]["slot"].processes[0].node
        assert {p.node for p in seen[0]["slot"].processes} == nodes
    finally:
        group.shutdown()
    group = WorkerGroup("masked", 4, use_gpu=True)
    try:
        group.build(Placed)
        seen = group.call(Placed.seen, 2)
        assert [s["visible"] for s in seen] == [str(p.gpu) for p in group.places()]
        assert {s["local_rank"] for s in seen} == {0}
        assert sorted(s["slot"].index for s in seen) == [0, 0, 1, 1]
    finally:
        group.shutdown()
