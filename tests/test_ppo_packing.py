"""PPO with ``data.use_remove_padding``: packed micro-batches give the padded ones' numbers."""

from pathlib import Path

import pytest
import torch

from megatron_rlhf.data.packing import grid_tensor, pack_token_grid, to_grid
from megatron_rlhf.rollout.base import Generation
from megatron_rlhf.trainers.rl.experience import build_batch

from tests.torchrun import torchrun_results

SCRIPT = Path(__file__).with_name("dist_ppo_packing.py")


def test_packed_grid_round_trips_every_token():
    prompts = [(5, 6, 7), (8, 9)]
    gens = [Generation(0, [10, 11], [], True), Generation(1, [12], [], True),
            Generation(0, [13, 14, 15, 16], [], False)]
    batch = build_batch(prompts, gens, pad_id=0)
    batch["values"] = torch.arange(batch["loss_mask"].numel(), dtype=torch.float).view_as(batch["loss_mask"])
    packed = pack_token_grid(batch, capacity=8)
    assert packed["input_ids"].shape[0] == 2  # 5 + 3 tokens share a row, 7 go alone
    valid = torch.arange(batch["input_ids"].shape[1])[None] < batch["lengths"]
    assert torch.equal(to_grid(packed["input_ids"], packed)[valid], batch["input_ids"][valid])
    assert torch.equal(to_grid(packed["targets"], packed) * batch["loss_mask"].long(),
                       batch["targets"] * batch["loss_mask"].long())
    assert torch.equal(grid_tensor(packed, "values"), batch["values"])
    # A padded batch's grid is the batch itself.
    assert torch.equal(to_grid(batch["input_ids"], batch), batch["input_ids"])


@pytest.fixture(scope="module")
def packing_results(tiny_models, tmp_path_factory):
    root = next(iter(tiny_models.values())).parent
    return torchrun_results(SCRIPT, 2, root, out=tmp_path_factory.mktemp("ppo_packing") / "results.json")


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_packed_ppo_matches_padded(packing_results, layout, agg):
    result = packing_results[f"{layout}/{agg}"]
    assert result["logprob_abs_max"] > 1.0  # real log-probs were compared
    assert result["rows"][1] * 2 == result["rows"][0]  # two samples per packed row
    assert 0 <= result["logprob_diff"] < 1e-5
    padded, packed = result["metrics_padded"], result["metrics_packed"]
    assert padded["tokens"] == packed["tokens"] > 0
    for key in ("pg_loss", "entropy", "kl", "clipfrac", "ppo_kl"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-5, abs=1e-6), key
    norms = result["grad_norm"]
    assert norms[0] > 0 and norms[1] == pytest.approx(norms[0], rel=1e-5)


@pytest.mark.parametrize("layout", ["dp2", "tp2", "tp2_sp", "pp2", "tied_tp2", "tied_pp2"])
@pytest.mark.parametrize("rows", ["padded", "packed"])
def test_lean_log_probs_entropy_and_gradients_match_full_logits(packing_results, layout, rows):
    result = packing_results[f"lean/{layout}/{rows}"]
    assert result["logprob_abs_max"] > 1.0 and result["grad_abs_max"] > 0  # real values compared
    assert 0 <= result["logprob_diff"] < 1e-5
    assert 0 <= result["grad_diff"] < 1e-5 * max(1.0, result["grad_abs_max"])
    full, lean = result["metrics_full"], result["metrics_lean"]
    assert full["tokens"] == lean["tokens"] > 0
    for key in ("pg_loss", "entropy", "kl", "clipfrac", "ppo_kl"):
        assert lean[key] == pytest.approx(full[key], rel=1e-5, abs=1e-6), key
    assert lean["entropy"] > 0
    assert result["grad_norm"][1] == pytest.approx(result["grad_norm"][0], rel=1e-5)


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_lean_update_allocates_no_tokens_by_vocabulary_logits(packing_results, layout):
    """torch.profiler's per-op allocations over one update of a 4096-token vocabulary model: with
    full logits some op allocates a micro-batch's [tokens x vocab/tp] floats; on the lean path
    (chunks of 8 tokens) no op allocates even half of that."""
    result = packing_results[f"lean_memory/{layout}"]
    assert result["full"] >= result["logits_bytes"] > 0
    assert result["lean"] < result["logits_bytes"] / 2


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_sdpa_core_attention_matches_megatrons_local_kernel(packing_results, layout):
    result = packing_results[f"attention/{layout}"]
    assert result["kind"] == "SDPADotProductAttention" and result["gqa"] == 2
    assert 0 <= result["relative_diff"] < 1e-5  # of the largest output or gradient (or 1)


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_token_budget_micro_batches_give_the_padded_update(packing_results, layout):
    result = packing_results[f"budget/{layout}"]
    assert result["rows"][1] < result["rows"][0]  # fewer, fuller micro-batches
    assert 0 <= result["grad_diff"] < 1e-5 * max(1.0, result["grad_abs_max"])
    padded, packed = result["metrics_padded"], result["metrics_packed"]
    assert padded["tokens"] == packed["tokens"] > 0
    for key in ("pg_loss", "entropy", "kl", "clipfrac", "ppo_kl"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-5, abs=1e-6), key


def test_token_groups_fill_micro_batches_longest_first():
    from megatron_rlhf.trainers.rl.micro_batches import token_groups

    lengths = torch.tensor([[16], [5], [23], [6], [18], [7], [14], [15], [50]])
    groups = token_groups(lengths, list(range(9)), 40)
    assert groups == [[8], [2, 0], [4, 7, 5], [6, 3, 1]]  # the 50-token row alone
    assert sorted(r for g in groups for r in g) == list(range(9))
    assert all(sum(int(lengths[r]) for r in g) <= 40 for g in groups[1:])
