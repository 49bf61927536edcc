"""Rank discovery and parallel-layout validation (pure: no process group is created)."""

import re

import pytest

from megatron_rlhf.distributed.launch import discover_rank, first_slurm_host
from megatron_rlhf.distributed.layout import ModelShape, ParallelLayout
from megatron_rlhf.errors import UserError

SHAPE = ModelShape(num_layers=4, num_attention_heads=8, num_query_groups=2, vocab_size=250)


@pytest.mark.parametrize("nodelist, host", [
    ("node1", "node1"),
    ("gpu[003-010,012]", "gpu003"),
    ("gpu[7,9],cpu1", "gpu7"),
    ("a-b-01,a-b-02", "a-b-01"),
    ("node-a[01-02]-ib", "node-a01-ib"),
    ("rack[1-2]-node[01-04],x9", "rack1-node01"),
])
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_torchrun_variables_win():
    info = discover_rank({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h",
                          "MASTER_PORT": "1234", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert (info.rank, info.world_size, info.local_rank, info.master_addr, info.master_port,
            info.source) == (3, 8, 1, "h", 1234, "torchrun")


def test_slurm_variables():
    info = discover_rank({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5",
                          "SLURM_JOB_NODELIST": "dgx[01-02]", "SLURM_JOB_ID": "4242"})
    assert (info.rank, info.world_size, info.local_rank, info.master_addr, info.source) == (
        5, 16, 5, "dgx01", "slurm")
    assert info.master_port == 20000 + 4242


def test_single_process_default():
    info = discover_rank({})
    assert (info.rank, info.world_size, info.source) == (0, 1, "single")


def test_resolve_fills_dp():
    assert ParallelLayout(tp=2, pp=2).resolve(8, SHAPE) == ParallelLayout(tp=2, pp=2, dp=2, ep=1)


def test_layers_pp_does_not_divide_are_split_as_evenly_as_megatron_allows():
    from megatron_rlhf.distributed.layout import even_split

    # DeepSeek-V3 (61 layers) as verl lays it out (PP12, a 6-layer last stage) and at PP16;
    # Qwen3-235B-A22B (94 layers) at PP8.
    assert ParallelLayout(pp=12).stage_layers(61) == [5] * 11 + [6]
    assert ParallelLayout(pp=16).stage_layers(61) == [2] + [4] * 14 + [3]
    assert ParallelLayout(pp=8).stage_layers(94) == [11] + [12] * 6 + [11]
    assert ParallelLayout(pp=3).stage_layers(4) == [1, 1, 2]
    assert ParallelLayout(pp=2).stage_layers(61) == [30, 31]
    assert ParallelLayout(pp=4).stage_layers(8) == [2, 2, 2, 2] and even_split(8, 4) == (None, None)
    for layers in range(2, 70):  # the search never leaves the middle stages unequal
        for pp in range(2, min(layers, 17) + 1):
            counts = ParallelLayout(pp=pp).stage_layers(layers)
            assert sum(counts) == layers and min(counts) >= 1 and len(set(counts[1:-1])) <= 1
    given = ParallelLayout(pp=12, last_stage_layers=6)
    assert given.stage_layers(61) == [5] * 11 + [6]
    assert "as given" in given.describe_stages(61)
    assert "split automatically" in ParallelLayout(pp=16).describe_stages(61)
    assert ParallelLayout(pp=4).describe_stages(8) is None


@pytest.mark.parametrize("layout, world, message", [
    (ParallelLayout(tp=3), 6, "attention heads (8) are not divisible by tp=3"),
    (ParallelLayout(tp=4), 4, "key/value heads (2) are not divisible by tp=4"),
    (ParallelLayout(pp=5), 5, "4 layers cannot fill pp=5 stages"),
    (ParallelLayout(pp=2, first_stage_layers=1, last_stage_layers=2), 2,
     "stages of 1 + 2 layers do not add up to the model's 4"),
    (ParallelLayout(pp=4, first_stage_layers=1, last_stage_layers=2), 4,
     "4 layers minus the first (1) and last (2) stages leave 1, which the 2 middle stage(s) "
     "cannot share evenly"),
    (ParallelLayout(pp=3, first_stage_layers=0), 3, "num_layers_in_first_pipeline_stage=0 must be >= 1"),
    (ParallelLayout(tp=2, pp=2), 6, "world size 6 is not divisible by tp*pp = 2*2 = 4"),
    (ParallelLayout(tp=2, dp=3), 4, "dp=3 but world size 4"),
    (ParallelLayout(tp=0), 1, "tp=0 must be >= 1"),
    (ParallelLayout(ep=2), 2, "ep=2 needs a mixture-of-experts model"),
    (ParallelLayout(tp=2, ep=2, etp=2), 2, "etp*ep = 2*2 must divide the 2 ranks"),  # as megatron-core
])
def test_invalid_layouts_name_the_problem(layout, world, message):
    with pytest.raises(UserError, match=re.escape("parallel layout: " + message)):
        layout.resolve(world, SHAPE)


def _parallel(**fields):
    from megatron_rlhf.config.schema import ParallelConfig

    return ParallelConfig(**fields)


@pytest.mark.parametrize("fields, message", [
    ({"sequence_parallel": True}, "parallel.sequence_parallel=true needs parallel.tp > 1"),
    ({"etp": 2, "ep": 2}, "parallel.etp=2 needs NCCL"),
    ({"recompute_granularity": "partial"}, "recompute_granularity='partial' must be one of full, selective"),
    ({"recompute_granularity": "selective", "recompute_method": "block"},
     "recompute_method/recompute_num_layers apply to parallel.recompute_granularity=full only"),
    ({"recompute_granularity": "full", "recompute_modules": ["mlp"]},
     "recompute_modules applies to parallel.recompute_granularity=selective only"),
    ({"recompute_granularity": "selective", "recompute_modules": ["moe_act"]},
     "moe_act needs grouped-GEMM experts"),
    ({"recompute_granularity": "selective", "recompute_modules": ["attention"]},
     "recompute_modules='attention' must be one of"),
])
def test_memory_feature_settings_are_checked_before_anything_starts(fields, message):
    from megatron_rlhf.config.parallel import check_parallel
    from megatron_rlhf.config.schema import MoEConfig

    with pytest.raises(UserError, match=re.escape(message)):
        check_parallel("parallel", _parallel(**fields), MoEConfig())


@pytest.mark.parametrize("family, fields, message", [
    ("qwen3_moe", {"tp": 2}, "parallel.tp=2 with a mixture-of-experts model needs "
                             "parallel.sequence_parallel=true"),
    ("qwen3", {"ep": 2}, "parallel.ep=2 needs a mixture-of-experts model"),
    ("qwen3", {"recompute_granularity": "selective", "recompute_modules": ["moe"]},
     "name MoE modules; qwen3 has no experts"),
    ("qwen3_moe", {"recompute_granularity": "selective", "recompute_modules": ["mla_up_proj"]},
     "mla_up_proj needs multi-latent attention"),
    ("qwen3", {"pp": 2, "recompute_granularity": "full", "recompute_method": "block",
               "recompute_num_layers": 3}, "recompute_num_layers=3 exceeds the 2 layers"),
])
def test_rules_that_depend_on_the_model(family, fields, message):
    from megatron_rlhf.config.parallel import check_parallel_for_model
    from megatron_rlhf.models.hf_config import arch_from_hf_config
    from megatron_rlhf.models.tiny import tiny_config

    arch = arch_from_hf_config(tiny_config(family))
    with pytest.raises(UserError, match=re.escape(message)):
        check_parallel_for_model("parallel", _parallel(**fields), arch)
