"""Whole-checkpoint conversion: HF folder -> Megatron distributed checkpoint, and back."""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from megatron_rlhf.checkpoint.model_ckpt import (check_writable, read_checkpoint_info,
                                                 save_model_checkpoint)
from megatron_rlhf.checkpoint.hf_io import HFReader
from megatron_rlhf.convert.streaming_export import export_hf
from megatron_rlhf.convert.streaming_import import streaming_strategy
from megatron_rlhf.convert.weights import hf_sources
from megatron_rlhf.distributed.launch import init_distributed
from megatron_rlhf.distributed.layout import ParallelLayout, build_parallel_groups
from megatron_rlhf.errors import UserError
from megatron_rlhf.models.builder import build_meta_model
from megatron_rlhf.models.hf_config import arch_from_hf_config, padded_vocab_size


def read_hf_arch(hf_dir: str | os.PathLike):
    """The checked architecture of an HF folder; :class:`UserError` if unreadable or unsupported."""
    from transformers import AutoConfig

    path = Path(hf_dir)
    if not (path / "config.json").is_file():
        raise UserError(f"missing config.json in {path}")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, OSError, KeyError) as err:
        raise UserError(f"cannot read {path / 'config.json'}: {str(err).splitlines()[0]}") from None
    return arch_from_hf_config(config)


def hf_to_mcore(hf_dir: str, out_dir: str, layout: ParallelLayout = ParallelLayout(),
                verify: bool = True) -> Path:
    """Convert an HF ``*ForCausalLM`` / ``*ForSequenceClassification`` folder into a checkpoint.

    Runs under any layout (all ranks call it); each rank reads only the tensors of its stage,
    streamed: no rank holds its model share (see :mod:`megatron_rlhf.convert.streaming_import`).
    ``verify``: read the written checkpoint back and compare it with the source, bitwise
    (:mod:`megatron_rlhf.convert.verify`), before marking it complete.
    """
    arch = read_hf_arch(hf_dir)
    reader = HFReader(hf_dir, mmap=False)
    check_writable(out_dir)
    init_distributed()
    groups = build_parallel_groups(layout, arch.shape)
    dtype = reader.dtype()
    padded = padded_vocab_size(arch.vocab_size, groups.layout.tp)
    model = build_meta_model(arch, groups, dtype, padded)
    strategy = streaming_strategy(model, reader, hf_sources(model, reader, arch, groups, padded),
                                  groups)
    check = None
    if verify:
        from megatron_rlhf.convert.verify import verify_checkpoint_against_hf

        def check(partial: Path) -> None:
            count = verify_checkpoint_against_hf(partial, hf_dir, arch, padded, dtype)
            if dist.get_rank() == 0:
                print(f"verified: the checkpoint's {count} tensors read back equal the source "
                      "bitwise", flush=True)

    return save_model_checkpoint(model, out_dir, arch, padded, dtype, hf_dir, strategy, check)


def mcore_to_hf(mcore_dir: str, out_dir: str, max_shard_bytes: int = 5 * 2**30,
                verify: bool = True, peft: bool = False) -> Path:
    """Export a checkpoint to an HF folder (safetensors, config, tokenizer), streaming; LoRA
    adapters are merged into the weights. ``peft``: write only a LoRA checkpoint's adapters, as
    a PEFT adapter folder for the HF base model (:func:`mcore_to_peft`).

    All ranks call it and share the work; each holds one output shard at a time, never the model
    (see :mod:`megatron_rlhf.convert.streaming_export`).
    """
    info = read_checkpoint_info(mcore_dir)
    out = check_writable(out_dir)
    init_distributed()
    groups = build_parallel_groups(ParallelLayout(), info.arch.shape)
    if peft:
        return mcore_to_peft(info, out, groups)
    return export_hf(info, out, groups, max_shard_bytes, verify)


def mcore_to_peft(info, out: Path, groups) -> Path:
    """A LoRA checkpoint's adapters as a PEFT folder (``adapter_config.json``,
    ``adapter_model.safetensors``); collective. Each rank loads the model with its adapters
    (not streamed: the base's bytes are read too)."""
    from megatron_rlhf.checkpoint.model_ckpt import load_model_checkpoint
    from megatron_rlhf.convert.peft import export_peft

    if info.lora is None:
        raise UserError(f"{info.path} holds no LoRA adapters (trained with model.lora.rank=0): "
                        "export it without --peft")
    model = load_model_checkpoint(info, groups, keep_adapters=True)
    export_peft(model, info.arch, groups, info.padded_vocab, info.lora, out)
    dist.barrier()
    return out


def peft_to_mcore(peft_dir: str, hf_dir: str, out_dir: str) -> Path:
    """A PEFT LoRA folder and its HF base -> one of our LoRA checkpoints (the base's weights with
    the adapters beside them, as LoRA training saves them), which reloads at any layout and
    trains on (``actor.model_path``, ``model.path``), scores, exports (``mcore-to-hf --peft``
    gives the same tensors back, bitwise, when the base is float32). Built at TP1/PP1 on every
    rank; an adapter for another base is refused before anything is written."""
    from megatron_rlhf.convert.peft import check_named_base, load_peft_adapters, peft_spec, read_peft
    from megatron_rlhf.convert.weights import load_hf_weights
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.models.lora import apply_lora

    config, tensors = read_peft(peft_dir)
    arch = read_hf_arch(hf_dir)
    spec = peft_spec(config, peft_dir, mla=arch.mla is not None)
    check_named_base(config, hf_dir, peft_dir)
    if arch.kind != "policy":
        raise UserError(f"{hf_dir} is a {arch.kind} model; PEFT adapters load onto a policy (causal LM)")
    check_writable(out_dir)
    init_distributed()
    groups = build_parallel_groups(ParallelLayout(), arch.shape)
    reader = HFReader(hf_dir)
    dtype, padded = reader.dtype(), padded_vocab_size(arch.vocab_size, 1)
    model = build_model(arch, groups, dtype, padded)
    load_hf_weights(model, reader, arch, groups, padded, progress=False)
    apply_lora(model, spec)
    load_peft_adapters(model, arch, groups, padded, tensors, peft_dir)
    return save_model_checkpoint(model, out_dir, arch, padded, dtype, hf_dir, lora=spec)
