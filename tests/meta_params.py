"""Every parameter megatron-core builds for one rank, against the planner's list, for layouts of
up to 64 ranks in one process: torch's ``fake`` process group stands in for the world (each
rank's real model is built on the meta device, no bytes, no communication).

Usage: python tests/meta_params.py OUT.json MODEL_DIR...  (run by tests/test_planner_params.py)
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rlhf.convert.checkpoints import read_hf_arch  # noqa: E402
from megatron_rlhf.distributed.layout import ParallelLayout, build_parallel_groups  # noqa: E402
from megatron_rlhf.distributed.platform import apply_platform  # noqa: E402
from megatron_rlhf.errors import UserError  # noqa: E402
from megatron_rlhf.models.builder import build_meta_model  # noqa: E402
from megatron_rlhf.models.hf_config import padded_vocab_size  # noqa: E402
from megatron_rlhf.planning.params import rank_tensors  # noqa: E402

# (layout, world size)
LAYOUTS = [(ParallelLayout(tp=2), 2), (ParallelLayout(pp=2), 2), (ParallelLayout(pp=3), 6),
           (ParallelLayout(tp=2, pp=2, ep=2), 8), (ParallelLayout(pp=4, ep=4), 16),
           (ParallelLayout(tp=4, pp=4, ep=4), 64), (ParallelLayout(pp=2, ep=2, etp=2), 8),
           (ParallelLayout(pp=3, first_stage_layers=2, last_stage_layers=1), 3)]


def _ranks(layout: ParallelLayout, world: int) -> list[int]:
    """The first rank of each pipeline stage, and the first 8 ranks of the last stage (its
    expert ranks: megatron numbers them fastest within a stage when etp = 1)."""
    per_stage = world // layout.pp
    firsts = [stage * per_stage for stage in range(layout.pp)]
    last = firsts[-1]
    return sorted(set(firsts + list(range(last, last + min(per_stage, 8)))))


def _build(arch, layout: ParallelLayout, world: int, rank: int):
    from megatron.core import parallel_state

    if dist.is_initialized():
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    groups = build_parallel_groups(layout, arch.shape)
    return groups, build_meta_model(arch, groups, torch.bfloat16,
                                    padded_vocab_size(arch.vocab_size, layout.tp))


def main() -> None:
    from megatron.core import parallel_state

    out, models = Path(sys.argv[1]), sys.argv[2:]
    apply_platform()
    # The fake backend has no gloo side groups (megatron's CPU-side helpers), which a model
    # build never uses.
    parallel_state.initialize_model_parallel = partial(parallel_state.initialize_model_parallel,
                                                       create_gloo_process_groups=False)
    results = []
    for path in models:
        arch = read_hf_arch(path)
        for layout, world in LAYOUTS:
            try:
                layout.resolve(world, arch.shape)
            except UserError:
                continue  # not a layout of this model (experts, heads)
            for rank in _ranks(layout, world):
                groups, model = _build(arch, layout, world, rank)
                built = [[name, p.numel()] for name, p in model.named_parameters()]
                planned = [[t.name, t.numel] for t in rank_tensors(arch, groups.layout, groups.pp_rank)]
                results.append({"model": Path(path).name, "layout": str(layout), "world": world,
                                "rank": rank, "stage": groups.pp_rank, "ep_rank": groups.ep_rank,
                                "built": built, "planned": planned})
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
