"""`megatron-rlhf train-rm`: a Bradley-Terry reward model on Megatron-Core.

Chosen and rejected responses go through the model in the same forward pass (packed into shared
rows when ``data.use_remove_padding``, their common prompt once with ``data.share_prompts``);
the reward is the value head at each sequence's last token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rlhf.algorithms.bradley_terry import bradley_terry_loss, pair_metrics
from megatron_rlhf.checkpoint.train_ckpt import CheckpointWriter
from megatron_rlhf.config.loader import BatchPlan, batch_plan, validate_rm_config
from megatron_rlhf.config.parallel import check_parallel_for_model, layout_of, model_options
from megatron_rlhf.config.schema import RMConfig, prompt_sharing
from megatron_rlhf.data.packing import pack_sequences, pack_shared
from megatron_rlhf.data.preference import TokenizedPair, load_pairs
from megatron_rlhf.data.chat import pad_id
from megatron_rlhf.distributed.launch import discover_rank, init_distributed
from megatron_rlhf.distributed.layout import ParallelGroups, build_parallel_groups
from megatron_rlhf.errors import UserError
from megatron_rlhf.models.forward import pipeline_forward
from megatron_rlhf.trainers.engine import (add_adapters, check_prompt_sharing, make_trainable,
                                          packing_supported, reduce_metrics,
                                          training_dtype)
from megatron_rlhf.trainers.loop import Run, epoch_order, run_job
from megatron_rlhf.trainers.rl.value_init import (build_value_model, resolve_value_source,
                                               reward_model_hf_config)

METRIC_KEYS = ["loss", "correct", "margin", "chosen", "chosen_sq", "rejected", "rejected_sq",
               "count", "tokens", "computed"]


@dataclass
class RMData:
    """The tokenised pairs and how a step's share of them is cut for this rank."""

    config: RMConfig
    groups: ParallelGroups
    plan: BatchPlan
    train_pairs: list[TokenizedPair]
    val_pairs: list[TokenizedPair]
    pad_id: int
    steps_per_epoch: int


def pair_batch(pairs: list[TokenizedPair], config: RMConfig, pad_id: int) -> dict:
    """Both sides of every pair in one batch: sequence ``2i`` is chosen, ``2i + 1`` rejected;
    with ``data.share_prompts`` the two sides of a pair share their prompt (:func:`pack_shared`)."""
    data = config.data
    sequences = [list(side) for p in pairs for side in (p.chosen, p.rejected)]
    capacity = data.max_prompt_length + data.max_response_length
    if data.share_prompts:
        packed = pack_shared(sequences, [i // 2 for i in range(len(sequences))], capacity, pad_id)
    else:
        packed = pack_sequences(sequences, capacity, pad_id, data.use_remove_padding)
    batch = {"input_ids": packed.input_ids, "attention_mask": packed.attention_mask,
             "last_index": packed.last_index, "num_tokens": packed.num_tokens,
             "computed_tokens": packed.computed_tokens,
             "margin": torch.tensor([p.margin for p in pairs])}
    if packed.position_ids is not None:
        batch["position_ids"] = packed.position_ids
    return batch


def pair_rewards(output: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``output [R, L, 1]`` -> (chosen ``[P]``, rejected ``[P]``) rewards at the last tokens."""
    index = batch["last_index"].to(output.device)
    values = output[index[:, 0], index[:, 1], 0].float()
    return values[0::2], values[1::2]


def rm_loss(output: torch.Tensor, batch: dict, config: RMConfig):
    chosen, rejected = pair_rewards(output, batch)
    margin = batch["margin"].to(chosen.device) if config.data.margin_column else None
    losses = bradley_terry_loss(chosen, rejected, margin, config.loss.center_coef)
    metrics = pair_metrics(chosen.detach(), rejected.detach())
    metrics["loss"] = losses.detach().sum()
    metrics["tokens"] = torch.tensor(float(batch["num_tokens"]))
    metrics["computed"] = torch.tensor(float(batch["computed_tokens"]))
    return losses.mean(), metrics


def summarize(sums: dict[str, float], prefix: str) -> dict[str, float]:
    n = max(sums["count"], 1.0)
    out = {f"{prefix}/loss": sums["loss"] / n, f"{prefix}/accuracy": sums["correct"] / n,
           f"{prefix}/margin_mean": sums["margin"] / n}
    # The tokens the model ran (a shared prompt once, padding included) and the pairs' own.
    out[f"{prefix}/tokens_computed"], out[f"{prefix}/tokens_sample"] = sums["computed"], sums["tokens"]
    for side in ("chosen", "rejected"):
        mean = sums[side] / n
        out[f"{prefix}/{side}_reward_mean"] = mean
        out[f"{prefix}/{side}_reward_std"] = math.sqrt(max(sums[f"{side}_sq"] / n - mean ** 2, 0.0))
    return out


def step_micro_batches(run: RMData, step: int) -> list[dict]:
    """This rank's micro-batches for global optimizer step ``step`` (0-based)."""
    plan, groups = run.plan, run.groups
    epoch, index = divmod(step, run.steps_per_epoch)
    order = epoch_order(len(run.train_pairs), run.config.trainer.seed, epoch, run.config.data.shuffle)
    start = index * plan.per_step + groups.dp_rank * plan.per_rank_step
    mine = [run.train_pairs[i] for i in order[start:start + plan.per_rank_step]]
    return [pair_batch(mine[i:i + plan.per_micro_batch], run.config, run.pad_id)
            for i in range(0, len(mine), plan.per_micro_batch)]


@torch.no_grad()
def evaluate(run: RMData, model) -> dict[str, float]:
    groups = run.groups
    mine = run.val_pairs[groups.dp_rank::groups.layout.dp]
    size, chunk = run.plan.per_micro_batch, 8  # micro-batches (and masks) alive at a time
    outputs = []
    for start in range(0, len(mine), size * chunk):
        part = mine[start:start + size * chunk]
        batches = [pair_batch(part[i:i + size], run.config, run.pad_id)
                   for i in range(0, len(part), size)]
        outputs += pipeline_forward(model, groups, batches,
                                    lambda out, batch: rm_loss(out, batch, run.config)[1])
    return summarize(reduce_metrics(outputs, groups, METRIC_KEYS), "val")


def _load_data(config: RMConfig, tokenizer) -> tuple[list[TokenizedPair], list[TokenizedPair]]:
    data = config.data
    limits = dict(tokenizer=tokenizer, max_prompt=data.max_prompt_length,
                  max_response=data.max_response_length, overlong=data.overlong,
                  margin_column=data.margin_column)
    train, report = load_pairs(data.train_files, **limits)
    _log(f"[train-rm] train data: {report}")
    val = []
    if data.val_files:
        val, val_report = load_pairs(data.val_files, **limits)
        _log(f"[train-rm] validation data: {val_report}")
    return train, val


def _log(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


def setup(config: RMConfig) -> Run:
    """Validate, read data (before any model is built), build model, optimizer and schedule."""
    from transformers import AutoTokenizer

    validate_rm_config(config)
    layout = layout_of(config.parallel)
    source = resolve_value_source(config.model.path, layout)
    check_parallel_for_model("parallel", config.parallel, source.arch)
    layout.resolve(discover_rank().world_size, source.arch.shape)  # before any group exists
    tokenizer = AutoTokenizer.from_pretrained(source.hf_dir, local_files_only=True)
    config.data.use_remove_padding = packing_supported(
        config.data.use_remove_padding, tag="train-rm")
    config.data.share_prompts = prompt_sharing(config.data.share_prompts,
                                               config.data.use_remove_padding)
    check_prompt_sharing(config.data.share_prompts, source.arch, config.parallel, "train-rm")
    init_distributed()
    groups = build_parallel_groups(layout, source.arch.shape, seed=config.trainer.seed)
    plan = batch_plan(config.data.train_batch_size, config.data.micro_batch_size_per_rank,
                      groups.layout.dp)
    train, val = _load_data(config, tokenizer)
    steps_per_epoch = len(train) // plan.per_step
    if steps_per_epoch == 0:
        raise UserError(f"config: {len(train)} training pairs are fewer than one step's "
                        f"data.train_batch_size={plan.per_step}")
    total = steps_per_epoch * config.trainer.total_epochs
    if config.trainer.max_steps:
        total = min(total, config.trainer.max_steps)
    model = build_value_model(source, groups, training_dtype(config.model.dtype),
                              config.trainer.seed, model_options(config.parallel, config.model.moe))
    lora = add_adapters(model, config.model.lora, config.trainer.seed, "train-rm")
    trainable = make_trainable(model, groups, config.optim, total,
                               config.parallel.use_distributed_optimizer)
    hf_config, export_tokenizer = reward_model_hf_config(source, tokenizer)
    meta = {"kind": "value", "family": source.arch.family, "padded_vocab": source.padded_vocab,
            **lora}
    checkpoints = CheckpointWriter(Path(config.trainer.output_dir) / "checkpoints", trainable,
                                   meta, hf_config, export_tokenizer, config.trainer.keep_last_n,
                                   config.trainer.async_save)

    _log(f"[train-rm] layout {groups.layout}; {plan.per_step} pairs/step = "
         f"{groups.layout.dp} ranks x {plan.micro_batches_per_step} micro-batches x "
         f"{plan.per_micro_batch} pairs; {total} steps")
    data = RMData(config, groups, plan, train, val, pad_id(tokenizer), steps_per_epoch)
    return Run(
        name="train-rm", config=config, trainer=config.trainer, groups=groups, trainable=trainable,
        total_steps=total, micro_batches=lambda step: step_micro_batches(data, step),
        loss=lambda output, batch: rm_loss(output, batch, config), metric_keys=METRIC_KEYS,
        summarize=summarize, evaluate=(lambda: evaluate(data, trainable.module)) if val else None,
        checkpoints=checkpoints, item="pairs", shown=("train/loss", "train/accuracy"))


def train_rm(config: RMConfig) -> dict[str, float]:
    validate_rm_config(config)
    return run_job("train-rm", config, setup)
