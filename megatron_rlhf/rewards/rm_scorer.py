"""Score (prompt, chosen, rejected) pairs with a Megatron reward model under any TP/PP/DP layout."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron_rlhf.checkpoint.model_ckpt import load_model_checkpoint, read_checkpoint_info
from megatron_rlhf.data.chat import pad_id, render_pair
from megatron_rlhf.data.packing import pack_shared
from megatron_rlhf.data.parquet import read_table, write_table_atomic
from megatron_rlhf.data.preference import PAIR_COLUMNS
from megatron_rlhf.distributed.launch import init_distributed
from megatron_rlhf.distributed.layout import ParallelGroups, ParallelLayout, build_parallel_groups
from megatron_rlhf.errors import UserError
from megatron_rlhf.models.forward import pad_right, pipeline_forward


@dataclass
class ScoreResult:
    chosen: list[float]
    rejected: list[float]

    @property
    def accuracy(self) -> float:
        wins = sum(c > r for c, r in zip(self.chosen, self.rejected))
        return wins / max(1, len(self.chosen))


def last_token_rewards(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``values [B, T, 1]``, ``lengths [B]`` -> reward at each sequence's last real token ``[B]``."""
    rows = torch.arange(values.shape[0], device=values.device)
    return values[rows, lengths.to(values.device) - 1, 0].float()


def score_sequences(model, groups: ParallelGroups, sequences: list[list[int]],
                    micro_batch_size: int, pad_id: int = 0, progress: bool = True,
                    prompt_of: list[int] | None = None) -> list[float]:
    """Reward of every token sequence; valid on the last pipeline stage, ``[]`` elsewhere.
    ``prompt_of``: which prompt each sequence answers; the sequences of one prompt in a
    micro-batch then share it (:func:`~megatron_rlhf.data.packing.pack_shared`), except under
    Transformer Engine, whose kernels ignore that layout's mask (each keeps its own copy)."""
    from megatron_rlhf.models.builder import uses_transformer_engine

    share = prompt_of is not None and not uses_transformer_engine()
    batches = []
    for start in range(0, len(sequences), micro_batch_size):
        part = sequences[start:start + micro_batch_size]
        if share:
            packed = pack_shared(part, prompt_of[start:start + micro_batch_size],
                                 max(len(s) for s in part), pad_id)
            batches.append({"input_ids": packed.input_ids, "attention_mask": packed.attention_mask,
                            "position_ids": packed.position_ids, "last_index": packed.last_index})
        else:
            tokens, lengths = pad_right(part, pad_id)
            batches.append({"input_ids": tokens, "lengths": lengths})
    rewards: list[float] = []
    chunk = 8  # micro-batches per pipeline schedule call: keeps the progress bar moving
    show = progress and dist.get_rank() == 0
    for start in tqdm(range(0, len(batches), chunk), desc="scoring", unit="chunk", disable=not show):
        outputs = pipeline_forward(model, groups, batches[start:start + chunk], _rewards_at_ends)
        rewards.extend(value for out in outputs for value in out.tolist())
    return rewards


def _rewards_at_ends(values: torch.Tensor, batch: dict) -> torch.Tensor:
    """The value at each sequence's last token: ``last_index`` (packed) or ``lengths``."""
    if "last_index" in batch:
        index = batch["last_index"].to(values.device)
        return values[index[:, 0], index[:, 1], 0].float()
    return last_token_rewards(values, batch["lengths"])


def _tokenize_rows(tokenizer, table: pa.Table, max_tokens: int, path: str) -> list[list[int]]:
    """Both sides of every row (``2i`` chosen, ``2i + 1`` rejected), checked on every rank so that
    a bad row stops all ranks together instead of leaving some waiting in a collective."""
    sequences = []
    prompts, chosen, rejected = (table.column(c).to_pylist() for c in PAIR_COLUMNS)
    for row in range(table.num_rows):
        for name, response in (("chosen", chosen[row]), ("rejected", rejected[row])):
            try:
                ids = render_pair(tokenizer, prompts[row], response)
            except UserError as err:
                raise UserError(f"{path}: row {row}: {err}") from None
            if len(ids) > max_tokens:
                raise UserError(f"{path}: row {row} prompt+{name} is {len(ids)} tokens, over the "
                                f"model's max_position_embeddings={max_tokens}")
            sequences.append(ids)
    return sequences


def score_pairs(model_dir: str, data: str, output: str, layout: ParallelLayout = ParallelLayout(),
                micro_batch_size: int = 8) -> ScoreResult | None:
    """Score every row of ``data``; rank 0 writes ``output`` and returns the result."""
    from transformers import AutoTokenizer

    info = read_checkpoint_info(model_dir)
    if info.arch.kind != "value":
        raise UserError(f"{model_dir} holds a {info.arch.kind} model, not a reward model")
    table = read_table(data, PAIR_COLUMNS)
    tokenizer = AutoTokenizer.from_pretrained(info.hf_dir, local_files_only=True)
    everything = _tokenize_rows(tokenizer, table, info.arch.max_position_embeddings, data)
    init_distributed()
    groups = build_parallel_groups(layout, info.arch.shape)
    model = load_model_checkpoint(info, groups)
    rows = list(range(groups.dp_rank, table.num_rows, groups.layout.dp))
    sequences = [everything[2 * row + side] for row in rows for side in (0, 1)]
    rewards = score_sequences(model, groups, sequences, micro_batch_size, pad_id(tokenizer),
                              prompt_of=[i // 2 for i in range(len(sequences))])
    owner = groups.is_last_stage and groups.tp_rank == 0
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (rows, rewards) if owner else None)
    if dist.get_rank() != 0:
        return None
    chosen, rejected = [0.0] * table.num_rows, [0.0] * table.num_rows
    for part in filter(None, gathered):
        for i, row in enumerate(part[0]):
            chosen[row], rejected[row] = part[1][2 * i], part[1][2 * i + 1]
    result = ScoreResult(chosen, rejected)
    table = table.append_column("chosen_reward", pa.array(chosen, pa.float32()))
    table = table.append_column("rejected_reward", pa.array(rejected, pa.float32()))
    write_table_atomic(table, output)
    return result
