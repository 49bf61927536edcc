"""Megatron-Core model builders: a policy (LM head) and a value/reward model (scalar head).

One value module serves both the PPO critic and the Bradley-Terry reward model: a ``GPTModel``
whose output layer is a ``[hidden] -> 1`` projection of the final-normed hidden state.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_rlhf.distributed.layout import ParallelGroups
from megatron_rlhf.distributed.platform import device, has_transformer_engine, platform_is_cpu
from megatron_rlhf.models.hf_config import ModelArch, padded_vocab_size, transformer_config


def uses_transformer_engine() -> bool:
    """Whether models are built from Transformer Engine layers (GPU with TE installed)."""
    return has_transformer_engine()


def layer_spec():
    """Transformer-Engine layer spec when TE imports (GPU), megatron's local spec otherwise."""
    from megatron.core.models.gpt import gpt_layer_specs

    if uses_transformer_engine():
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")


class ValueHead(nn.Module):
    """``[s, b, h] -> [s, b, 1]``, replicated on every TP rank; drop-in for GPTModel.output_layer."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, sequence_parallel: bool, tp_group):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device()))
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        del weight, runtime_gather_output  # part of the output-layer interface; unused here
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, group=self.tp_group)
        return torch.matmul(hidden_states, self.weight.t()), None


def build_model(arch: ModelArch, groups: ParallelGroups, dtype: torch.dtype = torch.float32,
                padded_vocab: int | None = None):
    """Build this rank's stage of ``arch`` under ``groups``' layout.

    ``padded_vocab`` fixes the embedding rows (a checkpoint's value); by default the vocab is
    padded for the layout's TP size. Returns a ``GPTModel`` on this process's device.
    """
    from megatron.core.models.gpt import GPTModel

    layout = groups.layout
    vocab = padded_vocab or padded_vocab_size(arch.vocab_size, layout.tp)
    if vocab % layout.tp:
        from megatron_rlhf.errors import UserError

        raise UserError(f"padded vocab {vocab} is not divisible by tp={layout.tp}")
    config = transformer_config(arch, layout.tp, layout.pp, dtype,
                                use_cpu_initialization=platform_is_cpu())
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(),
        vocab_size=vocab,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=groups.is_first_stage,
        post_process=groups.is_last_stage,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
        pg_collection=groups.collection,
    )
    if arch.kind == "value" and groups.is_last_stage:
        model.output_layer = ValueHead(arch.hidden_size, dtype, config.sequence_parallel, groups.tp)
    # Without Transformer Engine or apex, megatron's norms are torch's and ignore params_dtype:
    # a bf16 model kept fp32 norm weights, which megatron's mixed-precision optimizer then
    # misnumbered when saving its state (as Float16Module would, every parameter gets the dtype).
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    return model.to(device())
