"""The GPU configs under configs/{ppo,rm,sft}/gpu: each validates as its trainer validates it at
start-up (without the model files), and `megatron-rlhf plan` of its layout on its own node count
(trainer and colocated engine together, no offload: these configs keep the trainers' state on the GPU
while the engine generates) stays within 90% of an 80 GB GPU.

Each config's header names its model folder (``# model: configs/models/<m>``) and node count
(``# nodes: N``, the count its Slurm line books; PPO's must equal trainer.nnodes)."""

import contextlib
import io
import json
import re
from argparse import Namespace
from pathlib import Path

import pytest

from megatron_rlhf.config.loader import (batch_plan, load_config, validate_rm_config,
                                        validate_sft_config)
from megatron_rlhf.config.parallel import check_parallel_for_model, layout_of
from megatron_rlhf.config.schema import RMConfig, SFTConfig
from megatron_rlhf.convert.checkpoints import read_hf_arch
from megatron_rlhf.planning.command import run_plan

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p for job in ("ppo", "rm", "sft") for p in (ROOT / "configs" / job / "gpu").glob("*.yaml"))
LIMIT = 0.9 * 80 * 2 ** 30  # bytes per GPU


def header(path: Path) -> tuple[Path, int]:
    """(model folder, nodes) from the config's comment header."""
    text = path.read_text()
    model = re.search(r"^# model: (\S+)$", text, re.M)
    nodes = re.search(r"^# nodes: (\d+)$", text, re.M)
    assert model and nodes, f"{path.name}: header needs '# model: DIR' and '# nodes: N'"
    return ROOT / model.group(1), int(nodes.group(1))


def validate(path: Path, model: Path, gpus: int) -> None:
    """The trainers' start-up checks that need no files: the config alone, then its layout
    against the model's config.json and the job's GPUs. Paths (model, data) are not opened."""
    arch = read_hf_arch(model)
    if path.parent.parent.name == "ppo":
        from megatron_rlhf.config.ppo_checks import check_layout, validate_ppo_config
        from megatron_rlhf.config.ppo_schema import PPOConfig

        cfg = validate_ppo_config(load_config(PPOConfig, str(path), []))
        assert cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node == gpus, "header nodes != trainer.nnodes"
        assert cfg.rollout.backend == "sglang" and cfg.actor.dtype == "bfloat16"
        check_parallel_for_model("actor.parallel", cfg.actor.parallel, arch)
        layout = layout_of(cfg.actor.parallel).resolve(gpus, arch.shape)
        check_layout(cfg, gpus, layout.dp)
        return
    rm = path.parent.parent.name == "rm"
    cfg = load_config(RMConfig if rm else SFTConfig, str(path), [])
    (validate_rm_config if rm else validate_sft_config)(cfg)
    assert cfg.model.dtype == "bfloat16"
    check_parallel_for_model("parallel", cfg.parallel, arch)
    layout = layout_of(cfg.parallel).resolve(gpus, arch.shape)
    batch_plan(cfg.data.train_batch_size, cfg.data.micro_batch_size_per_rank, layout.dp)


def plan(path: Path, model: Path, gpus: int, **changes) -> dict:
    """The one layout of `megatron-rlhf plan --model M --gpus N --config YAML --json`."""
    args = Namespace(model=str(model), gpus=gpus, gpus_per_node=8, gpu_mem_gib=80.0,
                     config=str(path), seq_len=4096, micro_batch=1, global_batch=256,
                     recompute="selective", optimizer_offload=False, offload_during_rollout=False,
                     kernels="te", top=10, json=True, check=False)
    for key, value in changes.items():
        setattr(args, key, value)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert run_plan(args) == 0
    (layout,) = json.loads(out.getvalue())["layouts"]
    return layout


def fits(layout: dict) -> bool:
    """Within 90% of the GPU, and the engine's pool holds its weights (the planner's "fits")."""
    return layout["total_bytes_per_gpu"] <= LIMIT and layout["fits"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.parent.name}/{p.stem}")
def test_gpu_config_validates_and_fits_90_percent(path):
    model, nodes = header(path)
    validate(path, model, nodes * 8)
    layout = plan(path, model, nodes * 8)
    gib = layout["total_bytes_per_gpu"] / 2 ** 30
    assert fits(layout), f"{path.name}: {gib:.1f} GiB per GPU on {nodes} nodes ({layout['notes']})"
    if path.parent.parent.name == "ppo":
        assert "rollout_engine" in layout["bytes_per_gpu"]


def test_every_size_has_ppo_grpo_rm_and_sft():
    names = {f"{p.parent.parent.name}/{p.stem}" for p in CONFIGS}
    for size in ("qwen2.5-0.5b", "qwen2.5-7b", "qwen3-30b-a3b", "qwen2.5-72b", "qwen3-235b-a22b",
                 "deepseek-v3"):
        assert {f"ppo/{size}-ppo", f"ppo/{size}-grpo", f"rm/{size}", f"sft/{size}"} <= names


@pytest.mark.parametrize("change", [dict(gpus=64), dict(gpus=128, rollout_tp=1)],
                         ids=["half-the-nodes", "rollout-tp-1"])
def test_an_oversized_layout_is_reported(change, tmp_path):
    """The 72B PPO config on half its nodes, or with one-GPU engines (145 GB of weights in a
    32 GiB pool), does not pass."""
    path = ROOT / "configs" / "ppo" / "gpu" / "qwen2.5-72b-ppo.yaml"
    model, nodes = header(path)
    assert nodes * 8 == 128
    text = path.read_text()
    if "rollout_tp" in change:
        text, count = re.subn(r"(rollout:\n  backend: sglang\n  tp:) 8", r"\1 1", text)
        assert count == 1
    variant = tmp_path / path.name
    variant.write_text(text)
    assert not fits(plan(variant, model, change["gpus"]))
