"""One rank of a separate rollout group (``rollout.placement=separate``): its part of a rollout
engine laid over the group's own ranks, fed by the trainer group over a weight bridge
(:mod:`megatron_rlhf.rollout.bridge`)."""

from __future__ import annotations

import torch


class RolloutWorker:
    """Built by a :class:`~megatron_rlhf.orchestration.worker_group.WorkerGroup` of
    ``rollout.world_size`` ranks from the trainer's :meth:`PPOWorker.rollout_spec`."""

    def __init__(self, rollout, spec: dict):
        from megatron_rlhf.distributed.platform import apply_platform
        from megatron_rlhf.rollout.engines import make_generator

        apply_platform()
        self.generator = make_generator(rollout, spec["hf_dir"], spec["dtype"], spec["pad_id"],
                                        spec["eos_id"])
        self.bridge = None
        self.spans: dict[int, tuple[float, float]] = {}  # sampling seed -> (start, end)

    def open_bridge(self, host: str, port: int, size: int) -> None:
        import torch.distributed as dist

        from megatron_rlhf.distributed.platform import platform_is_cpu
        from megatron_rlhf.rollout.bridge import WeightBridge

        device = "cpu" if platform_is_cpu() else f"cuda:{torch.cuda.current_device()}"
        self.bridge = WeightBridge(host, port, 1 + dist.get_rank(), size, device)
        self.bridge.share_plan(None, None)

    def receive_weights(self) -> int:
        """Every bucket the trainer sends, into this rank's engine (buckets received)."""
        return self.bridge.receive(self.generator.load_weights)

    def generate(self, prompts: list[list[int]], params) -> tuple | None:
        import time

        from megatron_rlhf.rollout.engines import engine_share

        seed, start = params.seed, time.time()  # a step's seed names its generation
        result = engine_share(self.generator, prompts, params)
        self.spans[seed] = (start, time.time())
        while len(self.spans) > 16:  # the steps in flight at most, with room
            self.spans.pop(next(iter(self.spans)))
        return result

    def span(self, seed: int) -> tuple[float, float] | None:
        """Wall-clock (start, end) on this rank of the generation with sampling seed ``seed``."""
        return self.spans.get(seed)
