"""LoRA adapters of a (TP/PP-sharded) Megatron model -> a PEFT adapter folder for the HF model.

PEFT adapts each HF linear on its own: ``q_proj``, ``k_proj``, ``v_proj`` and ``gate_proj``,
``up_proj`` where megatron fuses them. A fused adapter ``B @ A`` splits exactly: the parts share
``A`` and each takes its rows of ``B`` (the same rows the HF map takes from the fused weight), so
``B_q @ A`` is exactly the q rows of the fused term. Same rank and ``alpha``, so the same scale.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rlhf.convert.mapping import COLS, REPLICATED, layer_offsets, rule_for, tp_unshard
from megatron_rlhf.distributed.layout import ParallelGroups
from megatron_rlhf.models.hf_config import ModelArch
from megatron_rlhf.models.lora import LoRASpec, adapters

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def _gather_tp(tensor: torch.Tensor, cut: str, groups: ParallelGroups) -> torch.Tensor:
    """The full tensor of TP-cut ``tensor`` (every TP rank gets it)."""
    if cut == REPLICATED or groups.layout.tp == 1:
        return tensor.detach().clone()
    pieces = [torch.empty_like(tensor) for _ in range(groups.layout.tp)]
    dist.all_gather(pieces, tensor.detach().contiguous(), group=groups.tp)
    return tp_unshard(pieces, cut)


def stage_adapters(model, arch: ModelArch, groups: ParallelGroups, padded_vocab: int,
                   field: str = "data") -> dict[str, torch.Tensor]:
    """This stage's adapters as HF-named PEFT tensors, full (gathered over TP; collective over
    the TP group): ``{hf_module}.lora_A.weight [rank, in]``, ``{hf_module}.lora_B.weight
    [out, rank]`` with ``hf_module`` e.g. ``model.layers.3.self_attn.q_proj``. ``field``: the
    parameters' ``data``, or their ``main_grad`` (megatron DDP's reduced gradient, laid out the
    same way)."""
    offsets = layer_offsets(model)
    out: dict[str, torch.Tensor] = {}
    for name, adapter in adapters(model):
        rule = rule_for(f"{name}.weight", arch, padded_vocab, offsets)
        a, b = getattr(adapter.lora_a, field), getattr(adapter.lora_b, field)
        if adapter.column:  # B's rows cut (and fused) as the base weight's rows
            a = _gather_tp(a, REPLICATED, groups)
            b_parts = rule.split(_gather_tp(b, rule.tp_cut, groups))
        else:
            a = _gather_tp(a, COLS, groups)
            b_parts = [_gather_tp(b, REPLICATED, groups)]
        for hf_name, b in zip(rule.hf_names, b_parts):
            module = hf_name.removesuffix(".weight")
            out[f"{module}.lora_A.weight"] = a.float().clone()  # one tensor per name (safetensors)
            out[f"{module}.lora_B.weight"] = b.float().contiguous()
    return out


def gathered_adapters(model, arch: ModelArch, groups: ParallelGroups, padded_vocab: int,
                      field: str = "data") -> dict[str, torch.Tensor]:
    """Every stage's :func:`stage_adapters`, on every rank (collective over the world)."""
    mine = stage_adapters(model, arch, groups, padded_vocab, field)
    if groups.tp_rank != 0 or groups.dp_rank != 0:
        mine = {}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {k: v.cpu() for k, v in mine.items()})
    return {k: v for part in everyone for k, v in part.items()}


_HF_MODULES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
               "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}


def adapter_config(spec: LoRASpec, base_model: str) -> dict:
    """PEFT's ``LoraConfig`` fields for ``spec`` (a causal-LM adapter)."""
    targets = sorted(name for target in spec.target_modules for name in _HF_MODULES[target])
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
            "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True,
            "inference_mode": True, "modules_to_save": None}


def export_peft(model, arch: ModelArch, groups: ParallelGroups, padded_vocab: int,
                spec: LoRASpec, out_dir: str | Path, base_model: str = "") -> Path | None:
    """Write ``out_dir/adapter_config.json`` and ``adapter_model.safetensors`` (PEFT's names:
    ``base_model.model.<hf module>.lora_[AB].weight``) from rank 0; collective over the world.
    Policies only (a reward model's PEFT adapter also needs its head: not yet)."""
    from safetensors.torch import save_file

    from megatron_rlhf.errors import UserError

    if arch.kind != "policy":
        raise UserError("PEFT export of LoRA adapters supports policies (causal LMs) only")
    tensors = gathered_adapters(model, arch, groups, padded_vocab)
    if dist.get_rank() != 0:
        return None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({f"base_model.model.{k}": v for k, v in sorted(tensors.items())},
              str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(adapter_config(spec, base_model), indent=2))
    return out
