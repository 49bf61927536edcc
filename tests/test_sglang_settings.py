"""What the sglang backend hands SGLang (megatron_rlhf/config/sglang.py): engine arguments from the
rollout config, a seed per sample, and names checked against the pinned SGLang's at start-up."""

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rlhf.config import sglang_names
from megatron_rlhf.config.ppo_schema import RolloutConfig
from megatron_rlhf.config.sglang import OURS, check_sglang_settings, engine_args, sampling_args
from megatron_rlhf.errors import UserError
from megatron_rlhf.rollout.base import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def test_every_sample_of_every_replica_has_a_seed_of_its_own():
    """Under deterministic inference one seed for a call would make every sample of a GRPO
    group the same sequence. Replicas' base seeds differ by their rank (the worker's
    ``seed * 1000 + generator DP rank``), as across steps."""
    seeds = []
    for step in range(3):
        for rank in range(8):
            params = SamplingParams(max_tokens=4, n=8, seed=(5 * 100003 + step) * 1000 + rank)
            rows = sampling_args(params, 256)
            assert len(rows) == 256
            seeds += [row["sampling_seed"] for row in rows]
    assert len(set(seeds)) == len(seeds) == 3 * 8 * 256
    assert all(0 <= s < 2 ** 63 for s in seeds)


def test_engine_arguments_come_from_the_config():
    cfg = RolloutConfig(backend="sglang", tp=2, ep=2, gpu_memory_utilization=0.6, seed=3,
                        deterministic=True, engine_args={"enable_dp_attention": True})
    args = engine_args(cfg, "/models/x", "bfloat16", 4)
    assert args == {"model_path": "/models/x", "tp_size": 2, "dtype": "bfloat16",
                    "load_format": "dummy", "enable_memory_saver": True,
                    "mem_fraction_static": 0.6, "base_gpu_id": 4, "random_seed": 3,
                    "enable_deterministic_inference": True, "ep_size": 2,
                    "enable_dp_attention": True}
    # The second node's process of an engine over two nodes
    spanning = engine_args(RolloutConfig(backend="sglang", tp=16), "/m", "bfloat16", 0,
                           nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000")
    assert (spanning["tp_size"], spanning["nnodes"], spanning["node_rank"],
            spanning["dist_init_addr"]) == (16, 2, 1, "10.0.0.1:5000")
    assert "enable_deterministic_inference" not in engine_args(RolloutConfig(), "/m", "bf16", 0)
    params = SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, top_k=0,
                            stop_token_ids=[5], seed=1)
    assert sampling_args(params, 1)[0] == {"max_new_tokens": 9, "temperature": 0.7, "top_p": 0.9,
                                           "top_k": -1, "stop_token_ids": [5],
                                           "sampling_seed": 2 ** 20}


def test_the_names_we_set_are_the_pinned_sglangs():
    assert set(OURS) <= sglang_names.SERVER_ARGS
    assert set(sampling_args(SamplingParams(max_tokens=1), 1)[0]) <= sglang_names.SAMPLING_PARAMS
    # The multi-GPU and multi-node settings the engine layouts need are there too.
    assert {"ep_size", "dp_size", "enable_dp_attention", "nnodes", "node_rank",
            "dist_init_addr"} <= sglang_names.SERVER_ARGS
    pins = (ROOT / "docker" / "constraints-gpu.txt").read_text()
    assert f"sglang=={sglang_names.VERSION}\n" in pins


@pytest.mark.parametrize("cfg, message", [
    (RolloutConfig(backend="sglang", engine_args={"ep_sise": 4}),
     "rollout.engine_args: SGLang 0.5.23 has no engine argument ep_sise"),
    (RolloutConfig(backend="sglang", engine_args={"tp_size": 4, "random_seed": 1}),
     "rollout.engine_args sets random_seed, tp_size, which the rollout backend sets"),
    (RolloutConfig(engine_args={"ep_size": 4}),
     "rollout.engine_args applies to rollout.backend=sglang only (the backend is hf)"),
    (RolloutConfig(backend="sglang", tp=4, engine_args={"ep_size": 4}),
     "rollout.engine_args sets ep_size, which the rollout backend sets from the config itself "
     "(rollout.tp, rollout.ep"),
    (RolloutConfig(deterministic=True),
     "rollout.deterministic applies to rollout.backend=sglang only"),
])
def test_a_setting_sglang_does_not_know_is_one_line(cfg, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_sglang_settings(cfg)
    check_sglang_settings(RolloutConfig(backend="sglang", deterministic=True, engine_args={
        "enable_dp_attention": True, "dp_size": 2}))


def test_an_unknown_engine_argument_stops_ppo_before_anything_starts(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rlhf.cli", "ppo", "--config", "configs/ppo/tiny_cpu.yaml",
         f"actor.model_path={tmp_path}", "critic.model_path=null", "reward.model_path=null",
         "reward.fn=addition", "rollout.backend=sglang", "rollout.engine_args={ep_sise: 4}",
         f"trainer.output_dir={tmp_path / 'out'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: config: rollout.engine_args: SGLang 0.5.23 has no engine argument ep_sise")
    assert not (tmp_path / "out").exists()
