"""LoRA adapters of a (TP/PP-sharded) Megatron model <-> a PEFT adapter folder for the HF model.

PEFT adapts each HF linear on its own: ``q_proj``, ``k_proj``, ``v_proj`` and ``gate_proj``,
``up_proj`` where megatron fuses them. A fused adapter ``B @ A`` splits exactly: the parts share
``A`` and each takes its rows of ``B`` (the same rows the HF map takes from the fused weight), so
``B_q @ A`` is exactly the q rows of the fused term. Same rank and ``alpha``, so the same scale.
Back (:func:`load_peft_adapters`): the parts' ``B`` rows fuse as the base weights do, and their
``A`` must be one (a PEFT adapter trained elsewhere usually has one ``A`` per part, which a fused
adapter of the same rank cannot hold: refused, with what to do instead).

Routed experts are written per expert, as PEFT names them on transformers 4's
``mlp.experts.<e>.{gate,up,down}_proj`` (the names our full export writes, and what transformers
5 and peft >= 0.21 convert on load into the fused 3-D expert parameters: ``gate_up_proj`` at rank
2r with its B block-diagonal, exactly the same sum).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rlhf.convert.mapping import (COLS, REPLICATED, layer_offsets, rule_for, tp_shard,
                                           tp_unshard)
from megatron_rlhf.errors import UserError
from megatron_rlhf.distributed.layout import ParallelGroups
from megatron_rlhf.models.hf_config import ModelArch
from megatron_rlhf.models.lora import SUPPORTED_TARGETS, LoRASpec, adapters

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def _gather_tp(tensor: torch.Tensor, cut: str, groups: ParallelGroups, expert: bool = False) -> torch.Tensor:
    """The full tensor of TP-cut ``tensor`` (every rank of its TP group gets it; a routed
    expert's: of the expert-TP group)."""
    group, size = (groups.etp, groups.layout.etp) if expert else (groups.tp, groups.layout.tp)
    if cut == REPLICATED or size == 1:
        return tensor.detach().clone()
    pieces = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(pieces, tensor.detach().contiguous(), group=group)
    return tp_unshard(pieces, cut)


def _rule(model_name: str, arch: ModelArch, groups: ParallelGroups, padded_vocab: int, offsets):
    experts = arch.moe.num_experts if arch.moe else 0
    return rule_for(f"{model_name}.weight", arch, padded_vocab, offsets,
                    expert_offset=groups.expert_offset(experts))


def stage_adapters(model, arch: ModelArch, groups: ParallelGroups, padded_vocab: int,
                   field: str = "data") -> dict[str, torch.Tensor]:
    """This stage's adapters as HF-named PEFT tensors, full (gathered over TP; collective over
    the TP group): ``{hf_module}.lora_A.weight [rank, in]``, ``{hf_module}.lora_B.weight
    [out, rank]`` with ``hf_module`` e.g. ``model.layers.3.self_attn.q_proj`` (a routed
    expert's, held by this expert-parallel rank: ``model.layers.3.mlp.experts.5.up_proj``).
    ``field``: the parameters' ``data``, or their ``main_grad`` (megatron DDP's reduced
    gradient, laid out the same way)."""
    offsets = layer_offsets(model)
    out: dict[str, torch.Tensor] = {}
    for name, adapter in adapters(model):
        rule = _rule(name, arch, groups, padded_vocab, offsets)
        a, b = getattr(adapter.lora_a, field), getattr(adapter.lora_b, field)
        if adapter.column:  # B's rows cut (and fused) as the base weight's rows
            a = _gather_tp(a, REPLICATED, groups, rule.expert)
            b_parts = rule.split(_gather_tp(b, rule.tp_cut, groups, rule.expert))
        else:
            a = _gather_tp(a, COLS, groups, rule.expert)
            b_parts = [_gather_tp(b, REPLICATED, groups, rule.expert)]
        for hf_name, b in zip(rule.hf_names, b_parts):
            module = hf_name.removesuffix(".weight")
            out[f"{module}.lora_A.weight"] = a.float().clone()  # one tensor per name (safetensors)
            out[f"{module}.lora_B.weight"] = b.float().contiguous()
    return out


ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")


def gathered_adapters(model, arch: ModelArch, groups: ParallelGroups, padded_vocab: int,
                      field: str = "data") -> dict[str, torch.Tensor]:
    """Every stage's :func:`stage_adapters`, on every rank (collective over the world): each
    tensor from one of the ranks holding it (a routed expert's: from its expert-parallel rank)."""
    mine = stage_adapters(model, arch, groups, padded_vocab, field)
    dense = groups.tp_rank == 0 and groups.dp_rank == 0
    routed = groups.etp_rank == 0 and groups.expt_dp_rank == 0
    mine = {k: v for k, v in mine.items() if (routed if ROUTED_EXPERT.search(k) else dense)}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {k: v.cpu() for k, v in mine.items()})
    return {k: v for part in everyone for k, v in part.items()}


_HF_MODULES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
               "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
# Multi-latent attention (DeepSeek-V3): one HF linear each.
_MLA_HF_MODULES = {"linear_q_proj": ("q_proj",), "linear_q_down_proj": ("q_a_proj",),
                   "linear_q_up_proj": ("q_b_proj",), "linear_kv_down_proj": ("kv_a_proj_with_mqa",),
                   "linear_kv_up_proj": ("kv_b_proj",)}


def adapter_config(spec: LoRASpec, base_model: str) -> dict:
    """PEFT's ``LoraConfig`` fields for ``spec`` (a causal-LM adapter)."""
    modules = {**_HF_MODULES, **_MLA_HF_MODULES}
    targets = sorted(name for target in spec.target_modules for name in modules[target])
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

    if arch.kind != "policy":
        raise UserError("PEFT export of LoRA adapters supports policies (causal LMs) only")
    tensors = gathered_adapters(model, arch, groups, padded_vocab)
    if dist.get_rank() != 0:
        return None
    note = _fused_experts_note(tensors)
    if note:
        print(f"[convert] note: {note}", flush=True)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({f"base_model.model.{k}": v for k, v in sorted(tensors.items())},
              str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(adapter_config(spec, base_model), indent=2))
    return out


def _fused_experts_note(tensors: dict[str, torch.Tensor]) -> str:
    """What a PEFT user must know when routed experts and other MLPs (shared experts, dense
    layers) are both adapted: peft 0.21 on transformers 5 retargets every ``gate_proj``,
    ``up_proj`` and ``down_proj`` to the fused routed experts and drops the others' adapters,
    silently (measured on a tiny DeepSeek-V3: 0.23 off in the test's logits; routed experts alone load
    exactly). The folder itself is PEFT's format, exact as written."""
    mlp = ("gate_proj", "up_proj", "down_proj")
    modules = {k.removeprefix(PREFIX).rsplit(".", 2)[0] for k in tensors if k.rsplit(".", 3)[-3] in mlp}
    plain = sorted(m for m in modules if not ROUTED_EXPERT.search(m + "."))
    if not plain or len(plain) == len(modules):
        return ""
    return (f"routed experts and {len(plain)} other MLP linears (e.g. {plain[0]}) are adapted: "
            "peft (0.21) on transformers >= 5 retargets gate_proj/up_proj/down_proj to the fused "
            "routed experts and drops the others' adapters when it loads this folder; load it with "
            "transformers 4 + peft, or into megatron-rlhf (convert peft-to-mcore), or export merged "
            "(without --peft) for transformers 5")


# --- PEFT -> our adapters -------------------------------------------------------------------------
PREFIX = "base_model.model."


def read_peft_config(folder: str | Path) -> dict:
    """A PEFT folder's ``adapter_config.json`` (both of its files checked to be there);
    :class:`UserError` naming what is missing."""
    folder = Path(folder)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise UserError(f"{folder} is not a PEFT adapter folder: no {name}")
    try:
        return json.loads((folder / CONFIG_FILE).read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{folder / CONFIG_FILE} is not JSON: {err}") from None


def read_peft(folder: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """:func:`read_peft_config` and the adapter's tensors by module name (PEFT's
    ``base_model.model.`` prefix removed)."""
    from safetensors.torch import load_file

    config = read_peft_config(folder)
    tensors = {k.removeprefix(PREFIX): v for k, v in load_file(str(Path(folder) / WEIGHTS_FILE)).items()}
    return config, tensors


def is_peft_folder(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


def peft_base(folder: str | Path, flag: str) -> Path:
    """The local HF folder a PEFT adapter folder names as its base (``base_model_name_or_path``);
    :class:`UserError` naming ``flag`` when it names none that exists here."""
    named = read_peft_config(folder).get("base_model_name_or_path") or ""
    if not named or not (Path(named) / "config.json").is_file():
        raise UserError(f"{flag}: {folder} is a PEFT adapter folder whose base "
                        f"({named or 'not named'}) is not a local Hugging Face folder; set "
                        f"base_model_name_or_path in its {CONFIG_FILE} to the base's folder, or "
                        f"convert it: megatron-rlhf convert peft-to-mcore --peft-dir {folder} "
                        "--hf-dir BASE --out-dir CKPT")
    return Path(named)


def peft_spec(config: dict, where: str, mla: bool = False) -> LoRASpec:
    """The :class:`LoRASpec` of a PEFT ``LoraConfig`` our adapters can hold exactly (``mla``: for
    a multi-latent attention base, whose ``q_proj`` is its own linear, not part of a fused one)."""
    groups = ({k: v for k, v in _HF_MODULES.items() if k != "linear_qkv"} | _MLA_HF_MODULES
              if mla else _HF_MODULES)
    target_of = {hf: target for target, parts in groups.items() for hf in parts}
    plain = {"peft_type": "LORA", "use_rslora": False, "use_dora": False, "bias": "none",
             "fan_in_fan_out": False}
    for key, want in plain.items():
        if config.get(key, want) != want:
            raise UserError(f"{where}: {key}={config.get(key)!r}; megatron-rlhf's adapters are plain "
                            f"LoRA ({key}={want!r})")
    if config.get("target_parameters"):  # what peft on transformers 5 saves for fused experts
        raise UserError(f"{where}: target_parameters {config['target_parameters']} adapt transformers "
                        "5's fused expert parameters at rank 2r over gate and up together, which "
                        "megatron-rlhf's expert adapters (rank r, one A shared by gate and up) cannot "
                        "hold (merge this adapter into its base instead: peft's merge_and_unload)")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if config.get(key):
            raise UserError(f"{where}: {key} is set; one rank and alpha for every adapted linear "
                            "of every layer is what megatron-rlhf's adapters hold")
    modules = config.get("target_modules") or []
    modules = [modules] if isinstance(modules, str) else list(modules)
    unknown = [m for m in modules if m not in target_of]
    if unknown:
        raise UserError(f"{where}: target_modules {unknown} are not linears megatron-rlhf adapts "
                        f"(it adapts {', '.join(sorted(target_of))})")
    targets = {target_of[m] for m in modules}
    for target in sorted(targets):
        parts = groups[target]
        absent = [m for m in parts if m not in modules]
        if absent:
            raise UserError(f"{where}: target_modules has {', '.join(sorted(set(parts) - set(absent)))} "
                            f"but not {', '.join(absent)}: megatron fuses {'/'.join(parts)} into "
                            f"{target}, whose adapter covers all of them (merge this adapter into its "
                            "base instead: peft's merge_and_unload)")
    return LoRASpec(rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                    dropout=float(config.get("lora_dropout", 0.0)),
                    target_modules=tuple(t for t in SUPPORTED_TARGETS if t in targets))


SAME_BASE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "intermediate_size", "vocab_size")


def check_named_base(config: dict, hf_dir: str | Path, where: str) -> None:
    """When ``base_model_name_or_path`` is a local folder, its config must describe the same
    model as ``hf_dir``'s (a hub name cannot be checked offline: the shapes are, on load)."""
    named = config.get("base_model_name_or_path") or ""
    if not named or not (Path(named) / "config.json").is_file():
        return
    named = Path(named)
    if named.resolve() == Path(hf_dir).resolve():
        return
    theirs, ours = (json.loads((folder / "config.json").read_text()) for folder in (named, Path(hf_dir)))
    differ = [k for k in SAME_BASE_KEYS if theirs.get(k) != ours.get(k)]
    if differ:
        k = differ[0]
        raise UserError(f"{where} was trained on {named} ({k}={theirs.get(k)!r}), not on {hf_dir} "
                        f"({k}={ours.get(k)!r}): load it onto its own base")


def load_peft_adapters(model, arch: ModelArch, groups: ParallelGroups, padded_vocab: int,
                       tensors: dict[str, torch.Tensor], where: str) -> None:
    """Set ``model``'s adapters (built by ``apply_lora`` with :func:`peft_spec`) to a PEFT
    folder's ``tensors``, cut for this rank. Every tensor must find its place, with its shape:
    an adapter for another base says where it does not fit."""
    offsets = layer_offsets(model)
    used: set[str] = set()
    for name, adapter in adapters(model):
        rule = _rule(name, arch, groups, padded_vocab, offsets)
        modules = [hf.removesuffix(".weight") for hf in rule.hf_names]
        a_parts, b_parts = ([_take(tensors, f"{m}.lora_{ab}.weight", where, used) for m in modules]
                            for ab in "AB")
        if any(not torch.equal(a_parts[0], a) for a in a_parts[1:]):
            raise UserError(f"{where}: {', '.join(modules)} each have their own lora_A; megatron fuses "
                            "them into one linear whose adapter has one A (merge this adapter into its "
                            "base instead: peft's merge_and_unload)")
        tp, rank = ((groups.layout.etp, groups.etp_rank) if rule.expert
                    else (groups.layout.tp, groups.tp_rank))
        a = a_parts[0] if adapter.column else tp_shard(a_parts[0], COLS, rank, tp)
        try:
            b = tp_shard(rule.merge(b_parts), rule.tp_cut, rank, tp) if adapter.column else b_parts[0]
        except (RuntimeError, ValueError):  # parts the base's head layout cannot fuse
            b = None
        for param, value, what in ((adapter.lora_a, a, "lora_A"), (adapter.lora_b, b, "lora_B")):
            if value is None or param.shape != value.shape:
                shapes = ", ".join(str(tuple(t.shape)) for t in (a_parts if what == "lora_A" else b_parts))
                raise UserError(f"{where} does not fit this base: {'/'.join(modules)} {what} of "
                                f"shape {shapes} cannot make the base's {name} adapter "
                                f"{tuple(param.shape)} (an adapter for another model?)")
            param.data.copy_(value.to(param.dtype))
    if dist.is_initialized() and dist.get_world_size() > 1:  # stages and EP ranks: the union
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, used)
        used = set().union(*everyone)
    left = sorted(set(tensors) - used)
    if left:
        raise UserError(f"{where} does not fit this base: {len(left)} tensor(s) adapt modules it does "
                        f"not have or that are not targeted, e.g. {left[0]} (an adapter for another "
                        "model?)")


def _take(tensors: dict, key: str, where: str, used: set) -> torch.Tensor:
    if key not in tensors:
        raise UserError(f"{where} does not fit this base: no {key} (an adapter for another model, "
                        "or with fewer layers?)")
    used.add(key)
    return tensors[key]
