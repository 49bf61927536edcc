"""MoE routing replay (``actor.router_replay``: R3, R2) on megatron-core's ``RouterReplay``."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_rlhf.data.packing import pack_token_grid, to_grid
from megatron_rlhf.errors import UserError
from megatron_rlhf.models.routing_replay import replay_targets, routing_agreement
from megatron_rlhf.rollout.base import Generation, SamplingParams
from megatron_rlhf.rollout.sglang_engine import routed_experts
from megatron_rlhf.trainers.rl.experience import build_batch
from megatron_rlhf.trainers.rl.routing import pass_mode
from tests.torchrun import torchrun_results

SCENARIO = Path(__file__).with_name("dist_routing.py")
MODELS = ("qwen3_moe", "deepseek_v3")
LAYOUTS = ("ep2", "pp2", "tp2sp", "ep2_recompute")


@pytest.fixture(scope="module")
def replayed(family_models, tmp_path_factory):
    root = family_models["qwen3_moe"].parent
    return torchrun_results(SCENARIO, 2, root, out=tmp_path_factory.mktemp("routing") / "out.json")


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_r3_replays_the_bf16_engines_routing_in_an_fp32_trainer(replayed, model, layout):
    key = f"{model}/{layout}"
    assert replayed[f"{key}/known_pairs"] > 300
    # A bfloat16 engine routes some tokens differently from the float32 trainer ...
    assert replayed[f"{key}/agreement_none"] < 1.0
    # ... and with R3 every (token, MoE layer) the engine routed uses exactly its experts, in
    # the scoring pass and in the update (and in recompute inside backward) ...
    assert replayed[f"{key}/r3_used_equals_engine"] == 1.0
    assert replayed[f"{key}/train_used_equals_engine"] == 1.0
    if "recompute" in layout:
        assert replayed[f"{key}/recompute_used_equals_engine"] == 1.0
    # ... which brings the trainer's log-probs closer to the engine's; the routers still learn.
    assert replayed[f"{key}/gap_r3"] < replayed[f"{key}/gap_none"]
    assert replayed[f"{key}/routers_moved_fraction"] == 1.0
    # R2: the routing recorded in a pass without replay is what the replaying pass uses.
    assert replayed[f"{key}/r2_used_equals_recorded"] == 1.0


def test_layouts_replay_the_same_thing(replayed):
    for model in MODELS:
        gaps = {replayed[f"{model}/{layout}/gap_r3"] for layout in LAYOUTS}
        assert max(gaps) - min(gaps) < 1e-5


def test_targets_follow_the_routers_token_order():
    """A router sees ``[s, b]`` flattened sequence-major; under sequence parallelism its TP
    rank's slice of the sequence."""
    b, t, layers, k = 2, 4, 3, 2
    routing = torch.arange(b * t * layers * k).view(b, t, layers, k)
    whole = replay_targets(routing, 1, 0, 1)
    assert whole.shape == (t * b, k)
    for s in range(t):
        for row in range(b):
            assert torch.equal(whole[s * b + row], routing[row, s, 1])
    second = replay_targets(routing, 1, 1, 2)  # TP rank 1 of 2: positions 2..3
    assert torch.equal(second, whole[2 * b:])


def test_agreement_compares_expert_sets_where_both_are_known():
    engine = torch.tensor([[[[0, 1]], [[2, 3]], [[-1, -1]]]])  # [1, 3, 1, 2]
    own = torch.tensor([[[[1, 0]], [[2, 1]], [[4, 5]]]])
    fraction, count = routing_agreement(own, engine)
    assert count == 2 and fraction == 0.5  # set {0,1} equal in another order; {2,3} != {1,2}


def test_engine_routing_rides_the_batch_and_the_packed_micro_batch():
    prompts = [[1, 2, 3], [4, 5]]
    gens = [Generation(0, [7, 8], [0.0, 0.0], True, routing=torch.full((4, 2, 2), 3, dtype=torch.int16)),
            Generation(1, [9], [0.0], True)]  # e.g. an offline sample: no routing
    batch = build_batch(prompts, gens, 0)
    routing = batch["routing"]
    assert routing.shape == (2, 5, 2, 2) and routing.dtype == torch.int16
    assert (routing[0, :4] == 3).all() and (routing[0, 4:] == -1).all() and (routing[1] == -1).all()
    micro = {k: batch[k] for k in ("input_ids", "targets", "loss_mask", "lengths")} | {"routing": routing}
    packed = pack_token_grid(micro, 8)
    assert packed["routing"].shape[:2] == packed["input_ids"].shape
    assert torch.equal(to_grid(packed["routing"], packed)[0, :4], routing[0, :4])


def test_which_passes_replay_and_record():
    engine = {"routing": torch.zeros(1)}
    assert pass_mode("none", engine, "old") == (False, True)  # measured every step
    assert pass_mode("none", engine, "update") == (False, False)
    assert pass_mode("R3", engine, "old") == (True, True)
    assert pass_mode("R3", engine, "ref") == (True, False)
    assert pass_mode("R3", engine, "update") == (True, False)
    assert pass_mode("R2", engine, "old") == (False, True)
    assert pass_mode("R2", engine, "update") == (True, False)
    assert pass_mode("R2", {}, "old") == (False, True)
    assert pass_mode("none", {}, "old") == (False, False)


def test_sglang_routed_experts_are_decoded_per_token():
    ids = np.arange(5 * 3 * 2, dtype=np.int32)  # 5 tokens run, 3 MoE layers, top-2
    meta = {"routed_experts": base64.b64encode(ids.tobytes()).decode()}
    routing = routed_experts(meta, 4, (3, 2))
    assert routing.shape == (4, 3, 2) and routing.dtype == torch.int16
    assert torch.equal(routing, torch.from_numpy(ids).view(5, 3, 2)[:4].short())
    with pytest.raises(RuntimeError, match="routed expert ids"):
        routed_experts(meta, 6, (3, 2))
    with pytest.raises(RuntimeError, match="enable_return_routed_experts"):
        routed_experts({}, 4, (3, 2))


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", "qwen2_moe"])
def test_hf_engine_records_what_a_full_forward_routes(family_models, name):
    """The engine's recorded routing (prefill + decode steps with a KV cache, left-padded
    prompts) equals the routing of one plain forward over prompt + response."""
    from transformers import AutoModelForCausalLM

    from megatron_rlhf.rollout.hf_engine import HFGenerator, _RoutedExperts

    path = family_models[name]
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    engine = HFGenerator(str(path), torch.float32, 0, 1)
    engine.load_weights(hf.state_dict().items())
    prompts = [[5, 17, 33, 8, 90], [44, 2, 61, 7, 19, 23, 120, 3, 77]]
    gens = engine.generate(prompts, SamplingParams(max_tokens=6, n=2, seed=3, routed_experts=True))
    for gen in gens:
        sequence = prompts[gen.prompt_index] + gen.tokens
        recorder = _RoutedExperts(hf, 1)
        with torch.no_grad():
            hf(torch.tensor([sequence[:-1]]))
        for hook in recorder.hooks:
            hook.remove()
        expected = torch.stack([torch.cat(steps, dim=1) for steps in recorder.steps], dim=2)[0]
        assert gen.routing.shape == (len(sequence) - 1, *expected.shape[1:])
        assert torch.equal(gen.routing.sort(-1).values, expected.sort(-1).values)


def test_replay_of_a_dense_policy_is_refused_and_offline_samples_are_said_once():
    from megatron_rlhf.trainers.rl.routing import check_routing_replay

    lines = []
    with pytest.raises(UserError, match="router_replay=R3.*dense"):
        check_routing_replay("R3", "/models/x", False, False, lines.append)
    check_routing_replay("R3", "/models/x", True, True, lines.append)
    assert len(lines) == 1 and "offline" in lines[0]
    check_routing_replay("none", "/models/x", False, True, lines.append)
    check_routing_replay("R2", "/models/x", True, True, lines.append)  # R2 records offline rows too
    assert len(lines) == 1
