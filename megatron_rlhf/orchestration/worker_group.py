"""Worker groups: N Ray actors forming one torch.distributed world with one parallel layout.

The driver calls a method on every rank at once (:meth:`WorkerGroup.call`); results come back in
rank order. A rank that dies or raises makes the call fail at once with the rank's name and
error instead of leaving the driver waiting on the ranks stuck in a collective with it.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from megatron_rlhf.errors import UserError


class WorkerFailed(UserError):
    """A worker raised or died; the message names the group, the rank and the cause."""


def _worker_class():
    import ray

    @ray.remote
    class RankActor:
        """One rank: sets the torch.distributed environment, then hosts a worker object."""

        def address(self) -> tuple[str, int]:
            import ray as _ray

            from megatron_rlhf.distributed.launch import free_port

            return _ray.util.get_node_ip_address(), free_port()

        def init(self, rank: int, world_size: int, master: tuple[str, int], threads: int) -> int:
            import torch

            from megatron_rlhf.distributed.launch import init_distributed, quiet_cpu_warnings

            quiet_cpu_warnings()
            node, gpus = self.place()
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size),
                              LOCAL_RANK=str(_local_device(gpus)), LOCAL_WORLD_SIZE="1",
                              MASTER_ADDR=master[0], MASTER_PORT=str(master[1]),
                              OMP_NUM_THREADS=str(threads), MRLHF_NODE=node,
                              MRLHF_NODE_IP=self.address()[0],
                              MRLHF_GPU=str(gpus[0]) if gpus else "")
            torch.set_num_threads(threads)
            return init_distributed().rank

        def build(self, factory, *args, **kwargs) -> None:
            self.obj = factory(*args, **kwargs)

        def call(self, method: str, *args, **kwargs):
            return getattr(self.obj, method)(*args, **kwargs)

        def pid(self) -> int:
            return os.getpid()

        def environ(self, name: str) -> str | None:
            return os.environ.get(name)

        def place(self) -> tuple[str, list[int]]:
            """(Ray node id, the GPU ids Ray gave this rank: declared ones on CPU too)."""
            import ray as _ray

            ids = [int(i) for i in _ray.get_gpu_ids()]
            return _ray.get_runtime_context().get_node_id(), ids

    return RankActor


# Ray hides every GPU but a worker's own unless this is set in the worker's environment; a
# rollout engine process spanning several GPUs of a node must see them all.
SEE_NODE_GPUS = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def _local_device(gpus: list[int]) -> int:
    """The CUDA device index of this worker's GPU: 0 when Ray made it the only visible one, else
    its position among the node's visible GPUs (Ray's ids are the node's, e.g. Slurm's 4-7)."""
    if not gpus or os.environ.get(SEE_NODE_GPUS) != "1":
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return visible.split(",").index(str(gpus[0]))
    return gpus[0]


class ResourcePool:
    """``size`` bundles (one device each: a GPU, or a CPU slot) in one Ray placement group; the
    worker groups placed on it share them, each rank taking ``1 / share`` of its bundle."""

    def __init__(self, name: str, size: int, use_gpu: bool):
        import ray
        from ray.util.placement_group import placement_group

        self.name, self.size, self.use_gpu = name, size, use_gpu
        self.bundle = {"CPU": 1, "GPU": 1} if use_gpu else {"CPU": 1}
        self.placement = placement_group([self.bundle] * size, strategy="PACK")
        ready, _ = ray.wait([self.placement.ready()], timeout=120)
        if not ready:
            raise UserError(f"resource pool {name}: Ray could not place {size} ranks with "
                            f"{self.bundle} each within 120 s (cluster resources: "
                            f"{ray.cluster_resources()})")

    def remove(self) -> None:
        import ray

        try:
            ray.util.remove_placement_group(self.placement)
        except Exception:  # already gone with the cluster
            pass


class WorkerGroup:
    """``world_size`` ranks, one per bundle of a :class:`ResourcePool` (its own unless given)."""

    def __init__(self, name: str, world_size: int, use_gpu: bool, threads_per_rank: int = 1,
                 pool: ResourcePool | None = None, share: int = 1, node_gpus: bool = False):
        """``node_gpus``: every rank sees all GPUs of its node (its own is its LOCAL_RANK), as
        the process of a rollout engine spanning them needs."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.name, self.world_size = name, world_size
        self.own_pool = pool is None
        self.pool = ResourcePool(name, world_size, use_gpu) if pool is None else pool
        if world_size > self.pool.size:
            raise UserError(f"worker group {name}: {world_size} ranks do not fit resource pool "
                            f"{self.pool.name} of {self.pool.size}")
        actor = _worker_class()
        # Groups sharing a pool take a fraction of each device: Ray packs them onto the same
        # GPUs (their engines release memory between phases), or the same CPU slots.
        fraction = 1.0 / share
        env = {"env_vars": {SEE_NODE_GPUS: "1"}} if node_gpus else None
        self.actors = [
            actor.options(num_cpus=fraction, num_gpus=fraction if use_gpu else 0, max_restarts=0,
                          runtime_env=env,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(
                              placement_group=self.pool.placement, placement_group_bundle_index=i),
                          ).remote()
            for i in range(world_size)]
        master = self._get([self.actors[0].address.remote()], "address")[0]
        self._get([a.init.remote(rank, world_size, master, threads_per_rank)
                   for rank, a in enumerate(self.actors)], "init_distributed")
    def build(self, factory, *args, **kwargs) -> None:
        """Construct ``factory(*args, **kwargs)`` on every rank (collectively)."""
        self._get([a.build.remote(factory, *args, **kwargs) for a in self.actors], "build")

    def call(self, method: Callable, *args, **kwargs) -> list[Any]:
        """``worker.method(*args, **kwargs)`` on every rank; results in rank order. ``method``
        is the worker class's function (``group.call(PPOWorker.update_actor, batch, step)``), so
        readers and tools can follow the call to its definition."""
        return self._get(self.submit(method, *args, **kwargs), method.__name__)

    def submit(self, method: Callable, *args, **kwargs) -> list:
        """:meth:`call` without waiting: the ranks' result references."""
        import ray

        # One object-store copy of large arguments, shared by every rank.
        args = tuple(ray.put(a) if _large(a) else a for a in args)
        return [a.call.remote(method.__name__, *args, **kwargs) for a in self.actors]

    def _get(self, refs: list, what: str) -> list[Any]:
        import ray

        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            failed = _failures(done, refs)
            if failed:
                # A rank that dies takes its peers' collectives down with it, and a peer's
                # "connection reset" can reach us before Ray reports the death: wait briefly
                # so the rank that started it is the one named.
                late, _ = ray.wait(pending, num_returns=len(pending), timeout=_GRACE_S)
                failed += _failures(late, refs)
                self.shutdown()
                raise WorkerFailed(_describe(self.name, what, failed))
        return ray.get(refs)

    def address(self) -> tuple[str, int]:
        """Rank 0's host address and a port free there."""
        return self._get([self.actors[0].address.remote()], "address")[0]

    def places(self):
        """Where each rank runs (:class:`~megatron_rlhf.distributed.engine_placement.Place`,
        rank order): its node and its GPU there; a rank without a GPU counts as its node's
        next slot, in rank order."""
        import ray

        from megatron_rlhf.distributed.engine_placement import Place

        found, slots = [], {}
        for rank, (node, gpus) in enumerate(ray.get([a.place.remote() for a in self.actors])):
            slot = gpus[0] if gpus else slots.get(node, 0)
            slots[node] = slots.get(node, 0) + 1
            found.append(Place(rank, node, slot))
        return found

    def pids(self) -> list[int]:
        import ray

        return ray.get([a.pid.remote() for a in self.actors])

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self.own_pool:
            self.pool.remove()
        time.sleep(0.1)


_GRACE_S = 5.0


def stitch(results: list) -> list:
    """Per-rank ``(dp_rank, value)`` results (``None`` from non-output ranks) in DP order."""
    return [value for _, value in sorted((r for r in results if r is not None), key=lambda r: r[0])]


def _failures(done: list, refs: list) -> list[tuple[int, Exception]]:
    """(rank, error) for each finished call in ``done`` that raised or whose rank died."""
    import ray

    failed = []
    for ref in done:
        try:
            ray.get(ref)
        except Exception as err:  # RayActorError (died) or RayTaskError (raised)
            failed.append((refs.index(ref), err))
    return failed


def _describe(group: str, what: str, failed: list[tuple[int, Exception]]) -> str:
    """Names the rank that died if one did (its peers only saw their collectives break), else
    the first to raise; the other failed ranks follow."""
    from ray.exceptions import RayActorError

    first = next((f for f in failed if isinstance(f[1], RayActorError)), failed[0])
    text = f"worker group {group!r} rank {first[0]} failed in {what}: {_cause(first[1])}"
    others = sorted(rank for rank, _ in failed if rank != first[0])
    if others:
        text += f" (rank(s) {', '.join(map(str, others))} failed too)"
    return text


def _large(value) -> bool:
    return isinstance(value, dict) and any(hasattr(v, "numel") and v.numel() > 4096
                                           for v in value.values())


def _cause(err: Exception) -> str:
    """The worker's own exception line rather than Ray's wrapper."""
    cause = getattr(err, "cause", None)
    if cause is not None and not isinstance(cause, type(err)):
        return f"{type(cause).__name__}: {cause}"
    text = str(err).strip().splitlines()
    return text[-1] if text else type(err).__name__


def call_together(*calls: tuple) -> list[list[Any]]:
    """``(group, method, *args)`` calls that meet in one collective (a weight bridge between two
    groups), started together and waited for together: each group's results, in call order. A
    rank failing in any group fails the call at once, naming that group (the others, left
    waiting in the collective, are shut down)."""
    import ray

    started = [(group, method.__name__, group.submit(method, *args)) for group, method, *args in calls]
    owner = {ref: index for index, (_, _, refs) in enumerate(started) for ref in refs}
    pending = list(owner)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        if _failures(done, list(owner)):
            group, name, refs = started[owner[done[0]]]
            try:
                group._get(refs, name)  # names the rank (and its peers that failed too)
            finally:
                for other, _, _ in started:
                    other.shutdown()
    return [ray.get(refs) for _, _, refs in started]
