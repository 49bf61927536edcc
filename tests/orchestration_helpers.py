"""Worker objects for tests/test_orchestration.py and tests/test_engine_placement.py
(importable by Ray workers)."""

import os
import time

import torch
import torch.distributed as dist


class Echo:
    def __init__(self, tag: str):
        self.tag = tag

    def whoami(self) -> tuple[str, int, int]:
        return self.tag, dist.get_rank(), dist.get_world_size()

    def all_reduce(self, value: float) -> float:
        tensor = torch.tensor([value + dist.get_rank()])
        dist.all_reduce(tensor)
        return tensor.item()

    def die_or_wait(self, victim: int) -> float:
        """``victim`` exits hard; the others block in a collective that can never finish."""
        if dist.get_rank() == victim:
            os._exit(13)
        return self.all_reduce(0.0)

    def break_then_die(self, victim: int) -> None:
        """Peers report a broken collective at once; ``victim`` exits a moment later, as a
        rank that crashes looks to a driver that hears from its peers first."""
        if dist.get_rank() == victim:
            time.sleep(1.0)
            os._exit(13)
        raise RuntimeError("Connection reset by peer")

    def fail(self, victim: int) -> None:
        if dist.get_rank() == victim:
            raise ValueError("bad row 7 in shard 3")
        self.all_reduce(0.0)


class Waiter:
    """Blocks in a collective, as a trainer group's ranks wait in a weight bridge."""

    def __init__(self, tag: str):
        self.tag = tag

    def wait_in_collective(self) -> None:
        if dist.get_rank() == 0:
            time.sleep(3600)
        dist.barrier()


class Placed:
    """What a rank learns about where it runs, and its rollout engine slot."""

    def seen(self, tp: int) -> dict:
        from megatron_rlhf.distributed.engine_placement import engine_groups, rank_places
        from megatron_rlhf.rollout.engines import place_engines

        slot = place_engines(tp)
        group = engine_groups(slot)
        total = torch.tensor([dist.get_rank()])
        dist.all_reduce(total, group=group)  # the engine's group holds exactly its members
        return {"places": rank_places(), "slot": slot, "members_sum": int(total),
                "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "local_rank": int(os.environ["LOCAL_RANK"])}
