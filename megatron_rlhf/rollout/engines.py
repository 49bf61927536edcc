"""Pick a rollout backend from the ``rollout`` config section, and lay its engines over the ranks
of a worker group (:mod:`megatron_rlhf.distributed.engine_placement`)."""

from __future__ import annotations

from dataclasses import replace

import torch

from megatron_rlhf.config.ppo_schema import RolloutConfig
from megatron_rlhf.distributed.layout import ParallelGroups
from megatron_rlhf.distributed.platform import platform_is_cpu
from megatron_rlhf.distributed.engine_placement import EngineSlot, engine_slots, rank_places
from megatron_rlhf.rollout.base import Generation


def place_engines(tp: int) -> EngineSlot:
    """This rank's slot in engines of ``tp`` GPUs over the whole world (collective)."""
    import torch.distributed as dist

    return engine_slots(rank_places(), tp)[dist.get_rank()]


def engine_share(generator, prompts: list[list[int]], params) -> tuple | None:
    """This rank's engine's samples of its share of ``prompts`` (engines split them like data
    parallel ranks), tagged with the engine's index, on the engine's head; None elsewhere."""
    import torch.distributed as dist

    slot, count = generator.slot, len(prompts)
    mine = prompts[slot.index * count // slot.count:(slot.index + 1) * count // slot.count]
    params.seed = params.seed * 1000 + slot.index
    result = generator.generate(mine, params)
    return (slot.index, result) if dist.get_rank() == slot.head else None


def engine_dtype(name: str, trainer: torch.dtype) -> torch.dtype:
    """``rollout.dtype``: ``auto`` is the trainer's dtype."""
    if name == "auto":
        return trainer
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def make_generator(cfg: RolloutConfig, hf_dir: str, dtype: torch.dtype, pad_id: int, eos_id: int,
                   groups: ParallelGroups | None = None, adopt_storage: bool = True):
    """This rank's part of a generator engine (weights arrive with the first weight sync); its
    ``slot`` says which engine and whether this rank reports the engine's samples. ``dtype`` is
    the trainer's; ``cfg.dtype`` may set another for the engine. ``adopt_storage=False``: the
    hf engine copies what the sync hands it (the trainer's parameters are offloaded after)."""
    slot = place_engines(cfg.tp)
    dtype = engine_dtype(cfg.dtype, dtype)
    if cfg.backend == "hf":
        from megatron_rlhf.rollout.hf_engine import HFGenerator

        device = "cpu" if platform_is_cpu() else f"cuda:{torch.cuda.current_device()}"
        engine = HFGenerator(hf_dir, dtype, pad_id, eos_id, device=device, slot=slot,
                             expert_parallel=cfg.ep > 1, adopt_storage=adopt_storage)
    elif cfg.backend == "sglang":
        from megatron_rlhf.rollout.sglang_engine import SGLangGenerator

        engine = SGLangGenerator(hf_dir, cfg, dtype, eos_id, slot)
    else:
        raise ValueError(f"rollout.backend={cfg.backend!r}: choose hf or sglang")
    engine.slot = slot
    return engine


def stitched(per_replica: list) -> list[Generation]:
    """The engines' ``(index, generations)`` in engine order, prompt indices made global."""
    out, offset = [], 0
    for _, part in sorted((r for r in per_replica if r is not None), key=lambda r: r[0]):
        for g in part:
            out.append(replace(g, prompt_index=g.prompt_index + offset))
        offset += len({g.prompt_index for g in part})
    return out
