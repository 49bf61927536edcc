"""The 2026 families against transformers: Qwen3, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 (with and
without q-LoRA, with YaRN), Llama 3.x RoPE scaling; TP/PP/EP layouts, EP vs EP=1, and the weight
sync of experts across EP ranks (4 gloo ranks, one launch)."""

import re
from pathlib import Path

import pytest

from tests.dist_families import LAYOUTS
from tests.tiny_models import FAMILY_MODELS
from tests.torchrun import torchrun_results

SCRIPT = Path(__file__).with_name("dist_families.py")
TOLERANCE = 1e-4  # fp32, as the acceptance asks; observed ~2e-7
MOE = ("qwen2_moe", "qwen3_moe", "deepseek_v3")


@pytest.fixture(scope="module")
def families(family_models, tmp_path_factory):
    work = tmp_path_factory.mktemp("families")
    root = next(iter(family_models.values())).parent
    return torchrun_results(SCRIPT, 4, root, work, out=work / "results.json")


@pytest.mark.parametrize("model, layout", [(m, label) for m in FAMILY_MODELS for label in LAYOUTS[m]])
def test_logits_match_transformers(families, model, layout):
    assert 0 <= families[f"logits/{model}/{layout}"] < TOLERANCE


@pytest.mark.parametrize("model", MOE)
@pytest.mark.parametrize("layout", ["ep2", "ep4", "tp2ep2"])
def test_expert_parallel_equals_ep1(families, model, layout):
    # Same tokens, same experts, only where they run: fp32 rounding at most.
    assert 0 <= families[f"ep_vs_ep1/{model}/{layout}"] < 1e-5


@pytest.mark.parametrize("layout", ["ep1", "tp2", "pp2", "tp2ep2"])
def test_checkpoint_saved_at_ep2_reloads_at_other_layouts(families, layout):
    assert 0 <= families[f"ckpt/ep2->{layout}"] < 1e-5


def test_checkpoint_imported_at_ep2_equals_transformers(families):
    # The streamed HF -> Megatron import, each EP rank writing its experts, reloaded at EP=2.
    assert 0 <= families["ckpt/ep2_import_vs_hf"] < TOLERANCE


@pytest.mark.parametrize("model, layout, stages", [
    ("qwen3_moe_3l", "pp2", [1, 2]), ("qwen3_moe_3l", "pp2ep2", [1, 2]),
    ("deepseek_v3_5l", "pp2", [2, 3]), ("deepseek_v3_5l", "pp4", [1, 1, 1, 2]),
    ("deepseek_v3_5l", "pp2_3+2", [3, 2]), ("deepseek_v3_5l", "pp2ep2", [2, 3])])
def test_uneven_pipeline_stages_equal_pp1(families, model, layout, stages):
    """Layer counts the pipeline size does not divide: split automatically (or as given), and
    the logits equal PP=1's (and transformers', in test_logits_match_transformers)."""
    assert families[f"stages/{model}/{layout}"] == stages
    assert 0 <= families[f"ep_vs_ep1/{model}/{layout}"] < 1e-5


@pytest.mark.parametrize("layout", ["pp1", "pp4", "pp2ep2"])
def test_checkpoint_saved_at_uneven_stages_reloads_at_other_layouts(families, layout):
    assert 0 <= families[f"ckpt/uneven_pp2->{layout}"] < 1e-5


def test_uneven_checkpoint_exports_back_to_the_same_hf_tensors(families):
    assert families["ckpt/uneven_roundtrip_missing"] == 0
    assert families["ckpt/uneven_roundtrip_max_diff"] == 0.0


@pytest.mark.parametrize("scenario", ["qwen3_moe_ep2", "deepseek_v3_tp2ep2", "qwen2_moe_pp2ep2",
                                      "deepseek_v3_5l_pp2", "qwen3_moe_3l_pp2ep2"])
def test_engine_logprobs_match_trainer_after_expert_sync(families, scenario):
    assert 0 <= families[f"sync/{scenario}"] < 1e-5
    assert families[f"sync_before/{scenario}"] > 1e-2  # the comparison can fail
    assert families[f"sync_bucket_over_expert/{scenario}"] < 1  # a bucket smaller than an expert
    assert families[f"sync_buckets/{scenario}"] > 1


def test_llama3_rope_scaling_is_applied(family_models):
    """Megatron's rotary frequencies are transformers' llama3-scaled ones, with the checkpoint's
    factors, and differ from plain RoPE (logits alone could pass on short sequences)."""
    import torch
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_rlhf.convert.checkpoints import read_hf_arch
    from megatron_rlhf.distributed.launch import init_distributed
    from megatron_rlhf.distributed.layout import ParallelLayout, build_parallel_groups
    from megatron_rlhf.models.builder import build_model

    arch = read_hf_arch(family_models["llama3_rope"])
    assert arch.rope_scaling.kind == "llama3" and arch.rope_scaling.factor == 8.0
    init_distributed()
    model = build_model(arch, build_parallel_groups(ParallelLayout(), arch.shape))
    config = AutoConfig.from_pretrained(family_models["llama3_rope"])
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (arch.rope_theta ** (torch.arange(0, arch.head_dim, 2).float() / arch.head_dim))
    torch.testing.assert_close(model.rotary_pos_emb.inv_freq.float(), scaled.float())
    assert not torch.allclose(scaled, plain)


@pytest.mark.parametrize("overrides, message", [
    ({"n_group": 4, "topk_group": 2}, re.escape("num_experts_per_tok == 2 * topk_group")),
    ({"norm_topk_prob": False}, "norm_topk_prob=false"),
    ({"rope_interleave": False}, "rope_interleave=false"),
])
def test_unreproducible_deepseek_configs_are_refused(overrides, message):
    from megatron_rlhf.errors import UserError
    from megatron_rlhf.models.hf_config import arch_from_hf_config
    from megatron_rlhf.models.tiny import tiny_config

    with pytest.raises(UserError, match=message):
        arch_from_hf_config(tiny_config("deepseek_v3", **overrides))


@pytest.mark.parametrize("family, overrides, message", [
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func='softmax': only sigmoid"),
    ("qwen2", {"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
    ("llama", {"mlp_bias": True}, "unsupported: mlp_bias=True"),
    ("qwen2", {"use_sliding_window": True}, "unsupported: use_sliding_window=True"),
    ("qwen3_moe", {"use_sliding_window": True}, "unsupported: use_sliding_window=True"),
])
def test_configs_the_models_would_not_reproduce_are_refused_naming_the_field(family, overrides,
                                                                             message):
    """The refusals the README lists, at read time (every command reads the config first)."""
    from megatron_rlhf.errors import UserError
    from megatron_rlhf.models.hf_config import arch_from_hf_config
    from megatron_rlhf.models.tiny import tiny_config

    config = tiny_config(family, **overrides)
    assert all(getattr(config, key) == value for key, value in overrides.items())
    with pytest.raises(UserError, match=re.escape(message)):
        arch_from_hf_config(config)
    arch_from_hf_config(tiny_config(family))  # the same model without the field reads


def test_rope_types_the_project_cannot_reproduce_are_refused():
    from megatron_rlhf.errors import UserError
    from megatron_rlhf.models.hf_config import arch_from_hf_config
    from megatron_rlhf.models.tiny import tiny_config

    dynamic = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(UserError, match="unsupported rope_type 'dynamic' for qwen3"):
        arch_from_hf_config(tiny_config("qwen3", rope_parameters=dynamic))


def test_multi_token_prediction_layers_are_dropped_on_import_with_one_line(family_models, tmp_path,
                                                                          capsys):
    """DeepSeek-V3 checkpoints store their MTP layer after the decoder (model.layers.61.* for
    the 61-layer model); transformers ignores it and so does the import, saying so once."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from megatron_rlhf.cli import main

    source = tmp_path / "with_mtp"
    shutil.copytree(family_models["deepseek_v3"], source)
    tensors = load_file(source / "model.safetensors")
    extra = {"model.layers.4.enorm.weight": torch.ones(64), "model.layers.4.eh_proj.weight": torch.ones(64, 128)}
    save_file({**tensors, **extra}, source / "model.safetensors", metadata={"format": "pt"})
    assert main(["convert", "hf-to-mcore", "--hf-dir", str(source), "--out-dir", str(tmp_path / "mcore")]) == 0
    out = capsys.readouterr().out
    assert out.count("dropping 2 multi-token-prediction tensors (model.layers.4.* and up)") == 1


@pytest.mark.parametrize("scenario", ["qwen3_pp2_to_engine_tp2", "qwen3_moe_ep4_to_engine_tp2ep2",
                                      "qwen3_moe_tp2ep2_to_engine_tp2"])
def test_engines_spanning_ranks_match_the_trainer_after_every_sync(families, scenario):
    """The transformers engine split over 2 or 4 ranks by the engine placement (TP, and TP x EP
    with experts split over the engine's ranks) takes the resharding sync from another layout."""
    assert families[f"engine_sync_before/{scenario}"] > 1e-2  # random weights: far off
    for attempt in (1, 2):
        assert 0 <= families[f"engine_sync/{scenario}/{attempt}"] < 1e-5
    # each rank holds about half: a shard of every split tensor (norms and router stay whole)
    assert families[f"engine_share/{scenario}"] < 0.6


@pytest.mark.parametrize("model", ["qwen3", "llama3_rope", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_every_family_trains(families, model):
    """Six Adam steps on a fixed batch at TP=2 (x EP=2 for MoE) through megatron DDP, the
    update every trainer uses: the loss falls and every parameter moves."""
    first, last = families[f"train/{model}/first_loss"], families[f"train/{model}/last_loss"]
    assert last < 0.95 * first, (first, last)  # measured 0.78-0.86 of the first
    assert families[f"train/{model}/unmoved_params"] == 0


@pytest.mark.parametrize("model", ["qwen3_moe", "deepseek_v3"])
def test_full_training_gradients_at_tp2_with_ep1_equal_tp1(families, model):
    """Every parameter's reduced, clipped gradient after one step at TP2 + SP (experts whole on
    each TP rank, EP1) equals TP1's (3.6e-7). Without the builder's expert tagging the largest
    gap was 1.3e-5 (Qwen3-MoE) / 3.5e-5 (DeepSeek-V3); without the platform's MLA fix 5.2e-4."""
    assert families[f"grad_parity/{model}/tensors"] == 1.0
    assert families[f"grad_parity/{model}/max_grad"] > 1e-3
    assert families[f"grad_parity/{model}/max_gap"] < 3e-6
