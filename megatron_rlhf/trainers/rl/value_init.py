"""Where a value/reward model starts: an HF LM (new scalar head), an HF reward model, or a checkpoint."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_rlhf.checkpoint.model_ckpt import META_FILE, load_model_checkpoint, read_checkpoint_info
from megatron_rlhf.convert.checkpoints import read_hf_arch
from megatron_rlhf.checkpoint.hf_io import HFReader
from megatron_rlhf.convert.weights import load_hf_weights
from megatron_rlhf.distributed.layout import ParallelGroups, ParallelLayout
from megatron_rlhf.errors import UserError
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.hf_config import ModelArch, padded_vocab_size


@dataclass(frozen=True)
class ValueSource:
    """A resolved ``model.path``: the value architecture and where its weights and files live."""

    path: Path
    arch: ModelArch
    hf_dir: Path  # config + tokenizer
    is_checkpoint: bool
    from_lm: bool  # an LM: the scalar head starts fresh
    padded_vocab: int


def resolve_value_source(path: str, layout: ParallelLayout) -> ValueSource:
    root = Path(path)
    if (root / META_FILE).is_file():
        info = read_checkpoint_info(root)
        if info.arch.kind != "value":
            raise UserError(f"{root} holds a {info.arch.kind} checkpoint; start a reward model from "
                            "its Hugging Face folder or a value checkpoint")
        return ValueSource(root, info.arch, info.hf_dir, True, False, info.padded_vocab)
    arch = read_hf_arch(root)
    from_lm = arch.kind == "policy"
    value_arch = dataclasses.replace(arch, kind="value", tie_word_embeddings=False)
    return ValueSource(root, value_arch, root, False, from_lm,
                       padded_vocab_size(arch.vocab_size, layout.tp))


def reward_model_source(path: str, layout: ParallelLayout,
                        key: str = "reward.model_path") -> ValueSource:
    """A frozen reward model to score with: a value checkpoint or an HF classifier, never a
    causal LM (its scalar head would be random). ``key`` names the setting in errors."""
    source = resolve_value_source(path, layout)
    if not source.is_checkpoint and source.from_lm:
        raise UserError(f"{key}: {path} is a causal LM, not a reward model (train one with "
                        "`megatron-rlhf train-rm`)")
    return source


def build_value_model(source: ValueSource, groups: ParallelGroups, dtype: torch.dtype, seed: int,
                      options=None):
    """This rank's stage of the value model, with weights from ``source``."""
    if source.is_checkpoint:
        return load_model_checkpoint(read_checkpoint_info(source.path), groups, dtype, options)
    model = build_model(source.arch, groups, dtype, source.padded_vocab, options)
    skip, unused = (), ()
    if source.from_lm:
        skip = ("output_layer.weight",)
        unused = ("lm_head.weight",)
        if groups.is_last_stage:
            # The same seed on every rank: the head is replicated across TP ranks.
            generator = torch.Generator().manual_seed(seed)
            std = 1.0 / math.sqrt(source.arch.hidden_size + 1)
            head = model.output_layer.weight
            with torch.no_grad():
                head.copy_(torch.randn(head.shape, generator=generator) * std)
    load_hf_weights(model, HFReader(source.hf_dir), source.arch, groups, source.padded_vocab,
                    progress=False, skip=skip, unused_ok=unused)
    return model


def reward_model_hf_config(source: ValueSource, tokenizer):
    """The HF config and tokenizer a trained reward model is exported with
    (``*ForSequenceClassification``).

    transformers' sequence-classification head reads the score at the last token that is not
    ``config.pad_token_id``. When padding is the EOS token (tokenizers without a pad token), a
    sequence ending in EOS, as our replies do without a chat template, would be read one token
    early there, while we score at the EOS. Such a tokenizer gets a pad token of its own in a
    spare embedding row when the vocabulary has one; otherwise the export says what to expect.
    """
    import copy

    import torch.distributed as dist
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source.hf_dir, local_files_only=True)
    family = config.architectures[0].split("For")[0]
    config.architectures = [f"{family}ForSequenceClassification"]
    config.num_labels = 1
    config.tie_word_embeddings = False
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    if eos is None or (pad is not None and pad != eos):
        config.pad_token_id = pad if pad is not None else config.pad_token_id
        return config, tokenizer
    if len(tokenizer) < config.vocab_size:
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.add_special_tokens({"pad_token": "<|rm_pad|>"})
        config.pad_token_id = tokenizer.pad_token_id
        return config, tokenizer
    config.pad_token_id = eos
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[export] the tokenizer pads with its EOS token and the vocabulary has no spare row "
              f"for a pad token: transformers' {config.architectures[0]} will read a batch's "
              "sequences that end in EOS one token early (megatron-rlhf scores at the EOS)",
              flush=True)
    return config, tokenizer
