"""Colocated offload (:mod:`megatron_rlhf.trainers.offload`): a round trip to host memory between
optimizer steps changes no bit of training at DP2, TP2, PP2 and EP2, with and without the
distributed optimizer (2 gloo ranks, one launch, ~15 s); the device storage is really freed and
the host buffers are made once."""

from pathlib import Path

import pytest

from tests.dist_offload import CASES
from tests.torchrun import torchrun_results

SCRIPT = Path(__file__).with_name("dist_offload.py")


@pytest.fixture(scope="module")
def offload_runs(tmp_path_factory):
    from megatron_rlhf.models.tiny import make_tiny_model, tiny_config

    root = tmp_path_factory.mktemp("offload")
    make_tiny_model(tiny_config("qwen2", "policy", num_layers=2), root / "dense", seed=1)
    make_tiny_model(tiny_config("qwen3_moe", "policy", num_layers=2), root / "moe", seed=2)
    return torchrun_results(SCRIPT, 2, root / "dense", root / "moe", out=root / "results.json")


@pytest.mark.parametrize("case", CASES)
def test_offload_between_steps_is_bitwise_invisible(offload_runs, case):
    result = offload_runs[case]
    assert result["bitwise"]  # losses, grad norms, parameters, main weights, Adam moments
    assert result["state_tensors"]  # the optimizer had state to move (compared above)
    assert result["bytes"] > 0


@pytest.mark.parametrize("case", CASES)
def test_offloaded_storage_is_freed_and_host_buffers_are_reused(offload_runs, case):
    assert offload_runs[case]["freed"]  # every storage 0 bytes while out
    assert offload_runs[case]["host_stable"]  # the same host buffers at every step


def test_fp32_main_weights_move_with_the_parameters(offload_runs):
    """fp32: the optimizer's main weights are the parameters (or views of their buffer), moved
    once; bf16 has fp32 main weights of its own: 18 vs 16 bytes per parameter without the
    distributed optimizer (params 4|2 + grads 4 + main 0|4 + moments 8)."""
    fp32, bf16 = offload_runs["dp2/plain"]["bytes"], offload_runs["dp2_bf16/plain"]["bytes"]
    assert abs(bf16 / fp32 - 18 / 16) < 1e-3
