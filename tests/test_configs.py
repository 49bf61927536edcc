"""Every shipped YAML loads into the typed config tree and validates; their layouts fit the models."""

from pathlib import Path

import pytest

from megatron_rlhf.config.loader import (batch_plan, load_config, validate_rm_config,
                                        validate_sft_config)
from megatron_rlhf.config.schema import RMConfig, SFTConfig
from megatron_rlhf.distributed.layout import ModelShape, ParallelLayout

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# (layers, heads, kv heads, vocab) of the models the GPU configs name, and their GPU counts.
GPU = {"qwen2.5-0.5b.yaml": (ModelShape(24, 14, 2, 151936), 8),
       "qwen2.5-7b.yaml": (ModelShape(28, 28, 4, 152064), 16)}


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("rm/*.yaml")), ids=lambda p: p.name)
def test_rm_configs_validate(path):
    config = validate_rm_config(load_config(RMConfig, str(path), []))
    if path.name in GPU:
        shape, gpus = GPU[path.name]
        layout = ParallelLayout(config.parallel.tp, config.parallel.pp).resolve(gpus, shape)
        plan = batch_plan(config.data.train_batch_size, config.data.micro_batch_size_per_rank,
                          layout.dp)
        assert plan.micro_batches_per_step >= 1
        assert config.model.dtype == "bfloat16"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("sft/*.yaml")), ids=lambda p: p.name)
def test_sft_configs_validate(path):
    validate_sft_config(load_config(SFTConfig, str(path), []))


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("ppo/*.yaml")), ids=lambda p: p.name)
def test_ppo_configs_validate(path):
    from megatron_rlhf.config.ppo_checks import validate_ppo_config
    from megatron_rlhf.config.ppo_schema import PPOConfig

    validate_ppo_config(load_config(PPOConfig, str(path), []))


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("multi_agent/*.yaml")), ids=lambda p: p.name)
def test_multi_agent_configs_validate(path):
    from megatron_rlhf.config.ppo_checks import validate_ppo_config
    from megatron_rlhf.config.ppo_schema import PPOConfig
    from megatron_rlhf.config.agents import agent_config, check_agents

    config = load_config(PPOConfig, str(path), [])
    validate_ppo_config(config)
    check_agents(config)
    for index, agent in enumerate(config.agents):
        validate_ppo_config(agent_config(config, agent, index))
