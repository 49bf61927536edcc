"""Shared prompts (``data.share_prompts``): the layout itself, and its parity with one copy of
the prompt per reply at every layout (tests/dist_shared_prompts.py, under torchrun)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rlhf.data.packing import grid_tensor, pack_token_grid, prompt_units, to_grid
from megatron_rlhf.rollout.base import Generation
from megatron_rlhf.trainers.rl.experience import build_batch
from tests.torchrun import torchrun_results

SCRIPT = Path(__file__).with_name("dist_shared_prompts.py")


def _batch():
    prompts = [(5, 6, 7, 8), (9, 10, 11)]
    gens = [Generation(0, [20, 21], [], True), Generation(0, [22], [], True),
            Generation(1, [23, 24, 25], [], True), Generation(0, [26, 27, 28], [], True)]
    batch = build_batch(prompts, gens, pad_id=0)
    batch["values"] = torch.arange(batch["loss_mask"].numel(), dtype=torch.float).view_as(batch["loss_mask"])
    return batch


def test_a_group_shares_its_prompt_but_the_last_token_and_maps_back_to_every_sample():
    batch = _batch()
    packed = pack_token_grid(batch, capacity=32, share_prompts=True)
    # Group 0 (samples 0, 1, 3): 3 shared prompt tokens, then [8 + reply] each; group 1 alone.
    assert packed["input_ids"].tolist() == [[5, 6, 7, 8, 20, 21, 8, 22, 8, 26, 27, 28,
                                             9, 10, 11, 23, 24, 25]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 3, 4, 3, 4, 5, 6,
                                                0, 1, 2, 3, 4, 5]]
    assert packed["packing"] == {"computed": 18, "sample": 24, "unshared_groups": 0}
    valid = torch.arange(batch["input_ids"].shape[1])[None] < batch["lengths"]
    assert torch.equal(to_grid(packed["input_ids"], packed)[valid], batch["input_ids"][valid])
    assert torch.equal(to_grid(packed["targets"], packed) * batch["loss_mask"].long(),
                       batch["targets"] * batch["loss_mask"].long())
    assert torch.equal(grid_tensor(packed, "values"), batch["values"])
    allowed = ~packed["attention_mask"][0, 0]
    # The second reply's tokens (columns 6, 7) see the shared prompt (0-2) and themselves only.
    assert allowed[7].nonzero().flatten().tolist() == [0, 1, 2, 6, 7]
    assert allowed[9].nonzero().flatten().tolist() == [0, 1, 2, 8, 9]
    # The lone group's first token sees itself only; nothing sees across groups.
    assert allowed[12].nonzero().flatten().tolist() == [12]
    assert not allowed[12:, :12].any() and not allowed[:12, 12:].any()


def test_without_sharing_the_packed_layout_is_todays():
    batch = _batch()
    plain = pack_token_grid(batch, capacity=32)
    assert "position_ids" not in plain
    assert plain["input_ids"].tolist() == [[5, 6, 7, 8, 20, 21, 5, 6, 7, 8, 22, 9, 10, 11, 23,
                                            24, 25, 5, 6, 7, 8, 26, 27, 28]]
    assert plain["packing"]["computed"] == plain["packing"]["sample"] == 24


def test_prompts_that_differ_share_only_their_common_start_and_are_counted():
    """A template that rendered one sample's prompt differently: its group shares the tokens
    that are the same (exact whatever they are) and counts as a group that could not share
    the whole prompt when nothing is common."""
    units, unshared = prompt_units([[1, 2, 3, 9], [1, 2, 4, 9], [7, 8], [5, 8]], [0, 0, 1, 1])
    assert [(u.members, u.prefix) for u in units] == [([0, 1], 1), ([2], 0), ([3], 0)]
    assert unshared == 1
    # Replies that start alike share more than the prompt.
    units, _ = prompt_units([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]], [0, 0])
    assert units[0].prefix == 3


def test_a_group_larger_than_the_row_gets_a_row_of_its_own():
    batch = _batch()
    packed = pack_token_grid(batch, capacity=8, share_prompts=True)
    assert packed["input_ids"].shape == (2, 12)  # group 0 (12 tokens) alone, group 1 (6) too


def test_token_budget_counts_a_shared_prompt_once():
    from megatron_rlhf.trainers.rl.micro_batches import shared_token_groups, token_groups

    batch = _batch()
    rows = list(range(4))
    # Group 0 costs 12 tokens shared (18 as copies); group 1, 6.
    assert shared_token_groups(batch, rows, 18) == [[0, 1, 3, 2]]
    assert shared_token_groups(batch, rows, 17) == [[0, 1, 3], [2]]
    assert len(token_groups(batch["lengths"], rows, 18)) == 2
    # A budget below the group's shared size splits it into parts that fit.
    parts = shared_token_groups(batch, rows, 10)
    assert sorted(r for g in parts for r in g) == rows and [0, 1, 3] not in parts


def test_group_major_order_keeps_groups_together():
    from megatron_rlhf.trainers.rl.micro_batches import group_major_order

    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    order = group_major_order(groups, torch.Generator().manual_seed(3))
    assert sorted(order) == list(range(9))
    runs = [int(groups[r]) for r in order]
    assert runs[0:3] == [runs[0]] * 3 and runs[3:6] == [runs[3]] * 3 and runs[6:] == [runs[6]] * 3
    assert [order[i:i + 3] == sorted(order[i:i + 3]) for i in (0, 3, 6)] == [True] * 3
    orders = {tuple(group_major_order(groups, torch.Generator().manual_seed(s))) for s in range(8)}
    assert len(orders) > 1  # the seed shuffles the groups


@pytest.fixture(scope="module")
def shared_results(tiny_models, family_models, tmp_path_factory):
    models = next(iter(tiny_models.values())).parent
    families = next(iter(family_models.values())).parent
    return torchrun_results(SCRIPT, 2, models, families,
                            out=tmp_path_factory.mktemp("shared_prompts") / "results.json")


@pytest.mark.parametrize("scenario", ["dp2", "tp2_sp", "pp2", "dp2_recompute", "dp2_lora",
                                      "dp2_distopt", "ep2_qwen3_moe", "ep2_deepseek_v3",
                                      "ep2_deepseek_v3_recompute", "pp2_deepseek_v3_5l"])
def test_shared_prompts_give_the_update_of_one_copy_per_reply(shared_results, scenario):
    """fp32: log-probs within 1e-6 of the largest (several are ~6 nats: one float step is
    4.8e-7 there), gradients within 1e-6 of the largest, parameters after three Adam steps
    within 1e-5 (each moved up to 2e-4); the prompt was shared (fewer tokens computed).
    Measured: log-probs 4.8e-7 to 9.5e-7, gradients 1.1e-8 to 5.2e-8 (of 0.02-0.08),
    parameters 1.9e-7 to 1.7e-6. Without the per-token RoPE positions: 1.7e-3, 2.0e-4, 4e-4."""
    result = shared_results[scenario]
    assert result["logprob_abs_max"] > 1.0 and result["grad_abs_max"] > 0  # real values compared
    assert 0 <= result["logprob_diff"] < 1e-6 * result["logprob_abs_max"]
    assert 0 <= result["grad_diff"] < 1e-6 * result["grad_abs_max"]
    assert result["param_moved"] > 1e-4 and 0 <= result["param_diff"] < 1e-5
    assert 0 < result["computed"] < result["sample"] * 0.7
    copies, shared = result["metrics_copies"], result["metrics_shared"]
    assert copies["tokens"] == shared["tokens"] > 0
    for key in ("pg_loss", "entropy", "kl", "clipfrac", "ppo_kl"):
        assert shared[key] == pytest.approx(copies[key], rel=1e-5, abs=1e-6), key


def test_a_preference_pair_shares_its_prompt():
    from megatron_rlhf.data.packing import pack_sequences, pack_shared

    pairs = [[1, 2, 3, 4, 10, 11], [1, 2, 3, 4, 12], [5, 6, 13], [5, 6, 14, 15]]
    shared = pack_shared(pairs, [0, 0, 1, 1], 32, 0)
    assert shared.input_ids.tolist() == [[1, 2, 3, 4, 10, 11, 4, 12, 5, 6, 13, 6, 14, 15]]
    assert shared.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 3, 4, 0, 1, 2, 1, 2, 3]]
    assert shared.last_index.tolist() == [[0, 5], [0, 7], [0, 10], [0, 13]]
    assert (shared.num_tokens, shared.computed_tokens) == (18, 14)
    plain = pack_sequences(pairs, 32, 0)
    assert plain.computed_tokens == plain.num_tokens == 18
    assert pack_sequences(pairs, 32, 0, remove_padding=False).computed_tokens == 4 * 6


@pytest.mark.parametrize("layout", ["rm_dp2", "rm_tp2_sp", "rm_pp2"])
def test_a_reward_model_scores_and_learns_the_same_on_shared_prompts(shared_results, layout):
    """Both sides' rewards within 1e-6 of the largest, one step's gradients within 1e-6 of the
    largest, the same loss and accuracy sums."""
    result = shared_results[layout]
    assert result["reward_abs_max"] > 0 and result["grad_abs_max"] > 0
    assert 0 <= result["reward_diff"] < 1e-6 * max(1.0, result["reward_abs_max"])
    assert 0 <= result["grad_diff"] < 1e-6 * result["grad_abs_max"]
    copies, shared = result["metrics_copies"], result["metrics_shared"]
    assert shared["computed"] < copies["computed"] and shared["tokens"] == copies["tokens"]
    for key in ("loss", "correct", "margin", "chosen", "rejected"):
        assert shared[key] == pytest.approx(copies[key], rel=1e-5, abs=1e-6), key


def test_a_group_is_split_where_its_row_would_outgrow_the_limit():
    """A packed row's mask is dense (its cost the square of the row): a group's unit stays under
    the limit by splitting the group; each part still shares the prompt."""
    tokens = [[1, 2, 3, 4, 5, 10 + i, 20 + i] for i in range(6)]
    units, unshared = prompt_units(tokens, [0] * 6, limit=14)
    assert [(u.members, u.prefix) for u in units] == [([0, 1, 2], 4), ([3, 4, 5], 4)]
    assert all(u.tokens([7] * 6) <= 14 for u in units) and unshared == 0
    units, _ = prompt_units(tokens, [0] * 6, limit=7)  # one member per unit: nothing shared
    assert [(u.members, u.prefix) for u in units] == [([i], 0) for i in range(6)]
