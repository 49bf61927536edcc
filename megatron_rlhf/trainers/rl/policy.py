"""The actor's models: the policy loaded from ``actor.model_path`` (LoRA adapters on it with
``actor.lora``) and the frozen reference policy its KL terms compare against.

Without adapters the reference is a second copy of the start weights (``actor.ref_model_path``,
default the policy's own). With adapters it is the policy itself with its adapters switched off
(:func:`megatron_rlhf.models.lora.adapters_disabled`): the base never trains, so it *is* the
start policy, and no second model is built or loaded.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rlhf.checkpoint.hf_io import HFReader
from megatron_rlhf.checkpoint.model_ckpt import META_FILE, load_model_checkpoint, read_checkpoint_info
from megatron_rlhf.config.ppo_schema import PPOConfig
from megatron_rlhf.convert.checkpoints import read_hf_arch
from megatron_rlhf.convert.peft import is_peft_folder, peft_base
from megatron_rlhf.convert.weights import load_hf_weights
from megatron_rlhf.distributed.layout import ParallelGroups
from megatron_rlhf.errors import UserError
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.hf_config import padded_vocab_size
from megatron_rlhf.models.lora import adapters


def policy_files(path: str):
    """(arch, HF folder with config and tokenizer) of ``actor.model_path``, without weights."""
    if (Path(path) / META_FILE).is_file():
        info = read_checkpoint_info(path)
        return info.arch, info.hf_dir
    if is_peft_folder(path):
        base = peft_base(path, "actor.model_path")
        return read_hf_arch(base), base
    if not (Path(path) / "config.json").is_file():
        raise UserError(f"actor.model_path: {path} is neither a megatron_rlhf checkpoint nor a "
                        "Hugging Face model folder")
    return read_hf_arch(path), Path(path)


@lru_cache(maxsize=None)
def policy_is_moe(path: str) -> bool:
    """A mixture-of-experts policy: its engines record their routing (R3 replays it, and
    ``moe/routing_agreement`` measures it every step)."""
    return bool(path) and policy_files(path)[0].moe is not None


def load_policy(path: str, groups: ParallelGroups, dtype: torch.dtype, options=None):
    """(model, arch, hf_dir, padded vocab) from an HF causal LM, a megatron_rlhf checkpoint or a
    PEFT adapter folder on its local base (a LoRA checkpoint's or PEFT folder's adapters come
    merged into the weights)."""
    if is_peft_folder(path):
        return load_peft_policy(path, groups, dtype, options)
    if (Path(path) / META_FILE).is_file():
        info = read_checkpoint_info(path)
        if info.arch.kind != "policy":
            raise UserError(f"actor.model_path: {path} holds a {info.arch.kind} checkpoint")
        return (load_model_checkpoint(info, groups, dtype, options), info.arch, info.hf_dir,
                info.padded_vocab)
    arch = read_hf_arch(path)
    if arch.kind != "policy":
        raise UserError(f"actor.model_path: {path} is a {arch.kind} model, not a causal LM")
    padded = padded_vocab_size(arch.vocab_size, groups.layout.tp)
    model = build_model(arch, groups, dtype, padded, options)
    load_hf_weights(model, HFReader(path), arch, groups, padded, progress=False)
    return model, arch, Path(path), padded


def load_peft_policy(folder: str | Path, groups: ParallelGroups, dtype: torch.dtype, options=None):
    """(model, arch, base folder, padded vocab): a PEFT adapter folder's base with the adapter
    merged into its weights (as a LoRA checkpoint loads for another job)."""
    from megatron_rlhf.convert.peft import load_peft_adapters, peft_spec, read_peft
    from megatron_rlhf.models.lora import apply_lora, merge_adapters

    base = peft_base(folder, "model path")
    config, tensors = read_peft(folder)
    arch = read_hf_arch(base)
    spec = peft_spec(config, str(folder), mla=arch.mla is not None)
    padded = padded_vocab_size(arch.vocab_size, groups.layout.tp)
    model = build_model(arch, groups, dtype, padded, options)
    load_hf_weights(model, HFReader(base), arch, groups, padded, progress=False)
    apply_lora(model, spec)
    load_peft_adapters(model, arch, groups, padded, tensors, str(folder))
    merge_adapters(model)
    return model, arch, base, padded


def reference_policy(cfg: PPOConfig, policy, padded: int, groups: ParallelGroups,
                     dtype: torch.dtype, options=None):
    """The frozen reference of ``policy`` (already loaded, adapters on it if any): ``policy``
    itself when it carries LoRA adapters (its log-probs are then taken under
    ``adapters_disabled``), else a second, frozen copy loaded from ``actor.ref_model_path`` (or
    ``actor.model_path``)."""
    if any(True for _ in adapters(policy)):
        if not dist.is_initialized() or dist.get_rank() == 0:
            print("[ppo] reference policy: the actor's base weights with its LoRA adapters "
                  "switched off (no second model built)", flush=True)
        return policy
    path = cfg.actor.ref_model_path or cfg.actor.model_path
    ref, _, _, ref_padded = load_policy(path, groups, dtype, options)
    if ref_padded != padded:
        raise UserError(f"actor.ref_model_path: {path} has a vocabulary of {ref_padded} (padded) "
                        f"tokens, the policy {padded}; a reference must share the policy's "
                        "tokenizer")
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref
