"""The planner's parameter counts: per rank, exactly the tensors megatron-core builds for that
rank (every family, up to 64 ranks, first / middle / last stages and each expert rank); per
model, the published sizes of the full-size models whose config.json ships in configs/models/."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rlhf.convert.checkpoints import read_hf_arch
from megatron_rlhf.planning.params import active_params, model_params

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def builds(tiny_models, family_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("meta") / "params.json"
    models = [*family_models.values(), tiny_models["qwen2_policy"], tiny_models["llama_policy"],
              tiny_models["llama_rm"], tiny_models["qwen3_moe_rm"]]
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "meta_params.py"), str(out),
                           *map(str, models)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_every_rank_holds_exactly_the_planned_tensors(builds):
    assert len(builds) > 100
    seen = {(b["model"], b["layout"]) for b in builds}
    assert any(b["world"] == 64 for b in builds) and len(seen) > 30
    for case in builds:
        assert case["built"] == case["planned"], (case["model"], case["layout"], case["rank"])


def test_the_cases_cover_every_kind_of_rank(builds):
    """First, middle and last stages, several expert ranks, tied embeddings split over stages,
    scalar heads, MLA with and without q-LoRA, first-k dense layers, shared experts."""
    assert {b["stage"] for b in builds if "pp=4" in b["layout"]} == {0, 1, 2, 3}
    assert len({b["ep_rank"] for b in builds if b["world"] == 64}) == 4
    names = {b["model"] for b in builds}
    assert {"deepseek_v3", "deepseek_v3_no_q_lora", "qwen2_moe", "qwen3_moe", "llama_policy",
            "llama_rm", "qwen3_moe_rm", "deepseek_v3_5l"} <= names


# name -> (total as Hugging Face's model page gives it, activated parameters as published)
PUBLISHED = {
    "qwen2.5-0.5b": (0.494e9, None), "qwen2.5-7b": (7.62e9, None), "qwen3-8b": (8.19e9, None),
    "qwen3-30b-a3b": (30.5e9, "3.3B"), "qwen2.5-72b": (72.7e9, None),
    "qwen3-235b-a22b": (235e9, "22B"), "deepseek-v3": (671e9, "37B"), "llama-3.1-70b": (70.6e9, None),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_full_size_models_match_their_published_sizes(name):
    arch = read_hf_arch(ROOT / "configs" / "models" / name)
    total, active = PUBLISHED[name]
    assert abs(model_params(arch) / total - 1) < 0.005
    if active is None:
        assert active_params(arch) == model_params(arch)
        return
    # Published activated counts are given to their last digit, cut (not rounded): 37.55B is
    # "37B". Embedding and output layer are counted, as the planner counts them.
    digits = active[:-1]
    step = 10 ** -len(digits.split(".")[1]) if "." in digits else 1
    assert float(digits) <= active_params(arch) / 1e9 < float(digits) + step
