"""Resharding weight sync: trainer TP2 -> engine TP1/TP2, PP2 -> engine TP1/TP2 (an engine
spanning both ranks), tiny buckets, tied PP2.

The engine's log-probs of its own greedy tokens must equal the trainer's (fp32, 1e-5) after one
sync, and be far from them before it (the engine starts with random weights).
"""

from pathlib import Path

import pytest
import torch

from tests.torchrun import torchrun_results

SCRIPT = Path(__file__).with_name("dist_weight_sync.py")


@pytest.fixture(scope="module")
def sync_results(tiny_models, tmp_path_factory):
    root = next(iter(tiny_models.values())).parent
    return torchrun_results(SCRIPT, 2, root, out=tmp_path_factory.mktemp("weight_sync") / "results.json")


@pytest.mark.parametrize("scenario", ["tp2_to_gen_tp1", "tp2_to_gen_tp2", "pp2_to_gen_tp1",
                                      "pp2_to_gen_tp2", "tp2_small_bucket",
                                      "llama_tied_pp2_to_gen_tp1"])
def test_engine_logprobs_match_trainer_after_sync(sync_results, scenario):
    result = sync_results[scenario]
    assert 0 <= result["max_abs_diff"] < 1e-5
    assert result["diff_before_sync"] > 1e-2  # the comparison can fail


@pytest.mark.parametrize("scenario", ["tp2_to_gen_tp1", "tp2_to_gen_tp2", "pp2_to_gen_tp2"])
def test_engine_releases_its_weights(sync_results, scenario):
    result = sync_results[scenario]
    assert result["resident_bytes"] > 100_000 and result["released_bytes"] == 0


def test_sglang_engine_head_gathers_payloads_in_tp_rank_order(sync_results):
    assert sync_results["sglang_payload_order"] == ["payload of rank 1", "payload of rank 0"]


def test_small_bucket_splits_into_many(sync_results):
    # 4 KiB buckets are smaller than most tensors: each such tensor travels alone.
    assert sync_results["tp2_small_bucket"]["buckets"] > 20
    assert sync_results["tp2_to_gen_tp1"]["buckets"] == 1
    assert sync_results["tp2_small_bucket"]["bytes"] == sync_results["tp2_to_gen_tp1"]["bytes"]


def test_bucket_plan_respects_size_and_stage():
    from megatron_rlhf.rollout.weight_sync import Entry, WeightSync

    plan = WeightSync.__new__(WeightSync)
    plan.dtype, plan.bucket_bytes = torch.float32, 64
    entries = [Entry(0, "a", (4,), (("x", (4,)),)), Entry(0, "b", (4,), (("y", (4,)),)),
               Entry(0, "c", (100,), (("z", (100,)),)), Entry(1, "d", (2,), (("w", (2,)),)),
               Entry(1, "e", (2,), (("x", (4,)),))]  # a tied copy of "x" on the last stage
    buckets = plan._plan(entries)
    assert [[e.name for e in b] for b in buckets] == [["a", "b"], ["c"], ["d"]]
