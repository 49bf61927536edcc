"""Pick a rollout backend from the ``rollout`` config section, and place generator replicas on
the ranks of a worker group."""

from __future__ import annotations

import torch

from megatron_rlhf.config.ppo_schema import RolloutConfig
from megatron_rlhf.distributed.layout import ParallelGroups
from megatron_rlhf.distributed.platform import platform_is_cpu


def generator_rank(rank: int, world_size: int, tp: int) -> tuple[int, int, bool]:
    """(generator DP rank, generator DP size, whether this rank returns the replica's output).

    A replica is ``tp`` consecutive ranks; its first rank reports.
    """
    if world_size % tp:
        raise ValueError(f"rollout.tp={tp} does not divide the worker group's {world_size} ranks")
    return rank // tp, world_size // tp, rank % tp == 0


def make_generator(cfg: RolloutConfig, hf_dir: str, dtype: torch.dtype, pad_id: int, eos_id: int,
                   groups: ParallelGroups):
    """A generator replica for this rank (weights arrive with the first weight sync)."""
    if cfg.backend == "hf":
        from megatron_rlhf.rollout.hf_engine import HFGenerator

        device = "cpu" if platform_is_cpu() else f"cuda:{torch.cuda.current_device()}"
        return HFGenerator(hf_dir, dtype, pad_id, eos_id, device=device, tp_size=cfg.tp)
    if cfg.backend == "sglang":
        from megatron_rlhf.rollout.sglang_engine import SGLangGenerator

        return SGLangGenerator(hf_dir, cfg, dtype, eos_id)
    raise ValueError(f"rollout.backend={cfg.backend!r}: choose hf or sglang")
