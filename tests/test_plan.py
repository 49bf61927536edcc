"""``megatron-rlhf plan`` on the full-size config.json fixtures: DeepSeek-V3 refused on 8 GPUs
(its weights alone exceed them), NeMo-RL's and verl's DeepSeek-V3 layouts accepted on their
published GPU counts (with the offloads those stacks use, in their configs; refused without), the JSON fields,
ranking, and one clear line for each kind of bad input."""

import json
import re
from pathlib import Path

import pytest

from megatron_rlhf.cli import main

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "configs" / "models"
NEMO_RL = ["--model", str(MODELS / "deepseek-v3"), "--gpus", "256", "--config",
           str(ROOT / "configs" / "plan" / "deepseek_v3_grpo_256xh100.yaml")]
VERL = ["--model", str(MODELS / "deepseek-v3"), "--gpus", "96", "--gpu-mem-gib", "96", "--config",
        str(ROOT / "configs" / "plan" / "deepseek_v3_grpo_96xh20.yaml"), "--optimizer-offload"]


def plan(capsys, *args):
    code = main(["plan", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_deepseek_v3_on_8_gpus_is_refused_naming_the_weights(capsys):
    code, out, err = plan(capsys, "--model", MODELS / "deepseek-v3", "--gpus", 8, "--check")
    assert code == 1 and "NO" in out and "yes" not in out
    assert err.strip().splitlines()[-1].startswith("error: plan: nothing fits 80 GiB GPUs")
    assert "weights alone need" in err


@pytest.mark.parametrize("args", [NEMO_RL, VERL], ids=["nemo-rl-256xh100", "verl-96xh20"])
def test_published_deepseek_v3_layouts_fit_on_their_gpu_counts(capsys, args, tmp_path):
    """Their configs offload the trainer during rollout (actor.offload), which the planner reads;
    the same configs without it do not fit, and the flag cannot override a config."""
    import yaml

    code, out, err = plan(capsys, *args, "--check", "--json")
    assert code == 0, err
    (layout,) = json.loads(out)["layouts"]
    assert layout["fits"] and layout["total_bytes_per_gpu"] < 96 * 2 ** 30
    assert {"weights", "gradients", "optimizer", "activations", "rollout_engine"} <= set(layout["bytes_per_gpu"])
    # The engine's static pool and the trainer's state cannot both stay on the GPU.
    config = Path(args[args.index("--config") + 1])
    raw = yaml.safe_load(config.read_text())
    for key in ("offload", "ref_offload"):
        raw["actor"].pop(key, None)
    resident = tmp_path / config.name
    resident.write_text(yaml.safe_dump(raw))
    args = [str(resident) if a == str(config) else a for a in args]
    code, _, err = plan(capsys, *args, "--check")
    assert code == 1 and "rollout_engine" in err
    code, _, err = plan(capsys, *args, "--offload-during-rollout", "--check")
    assert code == 2 and "set actor.offload.params: true" in err


def test_json_lists_ranked_layouts_with_every_field(capsys):
    code, out, _ = plan(capsys, "--model", MODELS / "qwen3-30b-a3b", "--gpus", 16, "--json")
    assert code == 0
    result = json.loads(out)
    assert abs(result["params_total"] / 30.5e9 - 1) < 0.005 and result["params_active"] < 4e9
    layouts = result["layouts"]
    assert len(layouts) > 10
    for layout in layouts:
        assert {"tp", "pp", "ep", "etp", "dp", "stages", "max_rank_params", "bytes_per_gpu",
                "total_bytes_per_gpu", "fits", "why"} <= set(layout)
        assert layout["tp"] * layout["pp"] * layout["dp"] == 16 and sum(layout["stages"]) == 48
        assert layout["total_bytes_per_gpu"] >= layout["bytes_per_gpu"]["weights"]
        variants = layout["state_bytes_by_optimizer"]
        shards = layout["dp"] > 1 or layout["tp"] > layout["ep"]  # a data-parallel group to shard over
        assert (variants["distributed"]["optimizer"] < variants["replicated"]["optimizer"]) == shards
        assert variants["distributed_cpu_offload"]["optimizer"] == 0
        assert variants["distributed_cpu_offload"]["optimizer_host"] == variants["distributed"]["optimizer"]
    fits = [layout["fits"] for layout in layouts]
    assert fits == sorted(fits, reverse=True)  # fitting layouts first
    assert any(layout["ep"] > 1 for layout in layouts) and any(layout["pp"] > 1 for layout in layouts)
    # More expert parallelism holds fewer experts per GPU.
    by_ep = {layout["ep"]: layout["max_rank_params"] for layout in layouts
             if layout["tp"] == 1 and layout["pp"] == 1}
    assert by_ep[8] < by_ep[2] < by_ep[1]


def test_uneven_stages_are_planned_for_61_layers(capsys):
    code, out, _ = plan(capsys, "--model", MODELS / "deepseek-v3", "--gpus", 256, "--json")
    layouts = json.loads(out)["layouts"]
    uneven = [layout for layout in layouts if layout["pp"] == 16]
    assert uneven and all(sum(layout["stages"]) == 61 for layout in uneven)
    assert any(layout["fits"] for layout in layouts)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_bad_input_is_one_clear_line(capsys, tmp_path):
    (tmp_path / "gpt2").mkdir()
    _write(tmp_path / "gpt2" / "config.json", json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    cases = {
        "supported": ("--model", tmp_path / "gpt2", "--gpus", 8),
        "config.json": ("--model", tmp_path, "--gpus", 8),
        "not divisible": ("--model", MODELS / "qwen2.5-7b", "--gpus", 12, "--config",
                          _write(tmp_path / "tp8.yaml", "model: {path: x}\nparallel: {tp: 8}\n")),
        "cannot share evenly": ("--model", MODELS / "deepseek-v3", "--gpus", 64, "--config",
                          _write(tmp_path / "split.yaml", "model: {path: x}\nparallel: {pp: 4, "
                                 "ep: 8, num_layers_in_first_pipeline_stage: 10, "
                                 "num_layers_in_last_pipeline_stage: 10}\n")),
        "do not split": ("--model", MODELS / "qwen2.5-7b", "--gpus", 16, "--config",
                         _write(tmp_path / "batch.yaml", "model: {path: x}\ndata: "
                                "{train_batch_size: 20, micro_batch_size_per_rank: 4}\n")),
    }
    for needle, args in cases.items():
        code, out, err = plan(capsys, *args)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), (needle, err)
        assert needle in lines[0], (needle, lines[0])


def test_an_in_process_command_leaves_no_job_clock_behind(capsys):
    """``trainer.stop_at`` durations count from a job's start, which main() passes to the
    processes it starts; a caller's later jobs (the test suite's subprocesses) must not inherit
    an old start (a 300 s deadline had already passed in a CI run)."""
    import os

    from megatron_rlhf.config.stopping import JOB_START_ENV

    os.environ.pop(JOB_START_ENV, None)
    plan(capsys, "--model", MODELS / "qwen2.5-0.5b", "--gpus", 1)
    assert JOB_START_ENV not in os.environ


def test_actor_lora_plans_no_reference_copy(tmp_path):
    from types import SimpleNamespace

    from megatron_rlhf.planning.command import _from_config

    config = tmp_path / "ppo.yaml"
    config.write_text("actor: {model_path: x}\nalgorithm: {use_kl_in_reward: true}\n")
    assert _from_config(str(config), SimpleNamespace(gpus=8))[1].reference
    config.write_text("actor: {model_path: x, lora: {rank: 8}}\nalgorithm: {use_kl_in_reward: true}\n")
    assert not _from_config(str(config), SimpleNamespace(gpus=8))[1].reference


@pytest.mark.parametrize("uses", ["trainer: {rollback: {kl_threshold: 0.5}}",
                                  "algorithm: {use_kl_in_reward: false, ref_log_prob: always}"],
                         ids=["kl_guard", "ref_log_prob_always"])
def test_a_run_whose_only_kl_use_is_the_guard_or_a_logged_kl_plans_the_reference(tmp_path, capsys, uses):
    """The trainer loads a reference model for the KL guard and for ``ref_log_prob=always``
    alone (config/ppo_checks.py: uses_reference); the plan counts its memory by the same rule."""
    config = tmp_path / "ppo.yaml"
    config.write_text(f"actor: {{model_path: {MODELS / 'qwen2.5-0.5b'}}}\n" + uses + "\n"
                      + ("" if uses.startswith("algorithm") else "algorithm: {use_kl_in_reward: false}\n"))
    code, out, _ = plan(capsys, "--model", MODELS / "qwen2.5-0.5b", "--config", config, "--gpus", 1,
                        "--json")
    assert code == 0
    assert all(p["bytes_per_gpu"]["reference"] > 0 for p in json.loads(out)["layouts"])


@pytest.mark.parametrize("model,gpus", [("qwen3-235b-a22b", 16), ("deepseek-v3", 32)])
def test_lora_plans_the_big_moe_models_on_a_few_nodes(capsys, model, gpus):
    """LoRA rank 32 on every linear (experts and MLA included): layouts fit where none does
    for full training, with gradients and optimizer state of the adapters alone."""
    runs = {}
    for rank in (0, 32):
        code, out, _ = plan(capsys, "--model", MODELS / model, "--gpus", gpus, "--lora-rank", rank, "--json")
        assert code == 0
        runs[rank] = json.loads(out)["layouts"]
    assert not any(p["fits"] for p in runs[0]) and any(p["fits"] for p in runs[32])
    by_layout = {(p["tp"], p["pp"], p["ep"]): p["bytes_per_gpu"] for p in runs[0]}
    for p in runs[32]:
        full = by_layout[(p["tp"], p["pp"], p["ep"])]
        terms = p["bytes_per_gpu"]
        assert terms["weights"] > 0  # still held (exact bytes: tests/test_planner_memory.py)
        assert terms["gradients"] < full["gradients"] / 20 and terms["optimizer"] < full["optimizer"] / 20
    code, out, _ = plan(capsys, "--model", MODELS / model, "--gpus", gpus, "--lora-rank", 32, "--top", 1)
    assert "LoRA rank 32 on" in out and "(megatron's local layers)" in out


def test_the_plan_says_which_terms_no_measurement_checked(capsys):
    """Activations under ``--kernels te`` (the default: what a GPU image runs) come from a
    formula never measured here; the plan says so in its text and its JSON, and not for the
    measured ``--kernels local``."""
    args = ("--model", MODELS / "qwen2.5-7b", "--gpus", 8, "--top", 1)
    _, out, _ = plan(capsys, *args)
    assert "(--kernels te), not measured by this project" in out
    _, out, _ = plan(capsys, *args, "--kernels", "local")
    assert "not measured" not in out and "measured: within 15%" in out
    for kernels, unmeasured in (("te", ["activations"]), ("local", [])):
        _, out, _ = plan(capsys, *args, "--kernels", kernels, "--json")
        assert json.loads(out)["unmeasured"] == unmeasured


def test_packed_rows_and_shared_prompts_are_planned_from_the_config(tmp_path):
    """A config's rows as the trainer lays them out (sharing resolved by the same rule, its
    refusal included), and their activations on megatron's local spec: a packed row's mask adds
    to padded rows, a shared prompt's row (up to SHARED_ROW_FACTOR rows wide, RoPE per token)
    adds more for the same tokens; Transformer Engine packs without a mask."""
    from dataclasses import replace
    from types import SimpleNamespace

    from megatron_rlhf.distributed.layout import ParallelLayout
    from megatron_rlhf.errors import UserError
    from megatron_rlhf.convert.checkpoints import read_hf_arch
    from megatron_rlhf.planning.command import _from_config
    from megatron_rlhf.planning.plan import Hardware, Run, evaluate

    config, args = tmp_path / "ppo.yaml", SimpleNamespace(gpus=8)
    packing = {}
    for name, data in {"shared": "{}", "packed": "{share_prompts: false}",
                       "none": "{use_remove_padding: false}"}.items():
        config.write_text(f"actor: {{model_path: x}}\ndata: {data}\n")
        packing[name] = _from_config(str(config), args)[1].packing
    assert packing == {"shared": "shared", "packed": "packed", "none": "none"}
    config.write_text("actor: {model_path: x}\ndata: {use_remove_padding: false, share_prompts: true}\n")
    with pytest.raises(UserError, match="share_prompts=true needs packed rows"):
        _from_config(str(config), args)

    arch = read_hf_arch(MODELS / "qwen2.5-0.5b")
    run, layout, hw = Run("ppo", seq=2048, micro_batch=4, global_batch=64), ParallelLayout(dp=8), Hardware(8)
    act = {(k, p): evaluate(arch, layout, hw, replace(run, kernels=k, packing=p)).terms["activations"]
           for k in ("local", "te") for p in ("none", "packed", "shared")}
    assert act["local", "none"] < act["local", "packed"] < act["local", "shared"]
    assert act["te", "none"] == act["te", "packed"] == act["te", "shared"]
    # The planner's copy of the packing rule (planning may not import data).
    from megatron_rlhf.data import packing
    from megatron_rlhf.planning import plan

    assert plan.SHARED_ROW_FACTOR == packing.SHARED_ROW_FACTOR


def test_sglang_holds_a_prompt_once_for_its_samples(tmp_path, capsys):
    """The KV note of a GRPO config: SGLang's radix cache keeps a group's prompt once, so its
    pool holds more samples than whole sequences (prompt 1024 + reply 1024, n 8: a sample costs
    1024 + 128 tokens)."""
    config = tmp_path / "ppo.yaml"
    config.write_text(f"actor: {{model_path: {MODELS / 'qwen2.5-0.5b'}}}\n"
                      "data: {max_prompt_length: 1024, max_response_length: 1024}\n"
                      "rollout: {n: 8, backend: sglang}\nalgorithm: {adv_estimator: grpo, use_kl_in_reward: false}\n")
    code, out, _ = plan(capsys, "--model", MODELS / "qwen2.5-0.5b", "--config", config, "--gpus", 1,
                        "--json")
    assert code == 0
    notes = " ".join(n for p in json.loads(out)["layouts"] for n in p["notes"])
    tokens, whole, shared = (int(x.replace(",", "")) for x in re.search(
        r"KV cache for ([\d,]+) tokens per engine \(([\d,]+) sequences of 2048; ([\d,]+) with each "
        r"prompt of 1024 held once for its 8 samples", notes).groups())
    assert abs(whole - tokens / 2048) <= 1 and abs(shared - tokens / 1152) <= 1
