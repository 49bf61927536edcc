"""`megatron-rlhf sft`: supervised fine-tuning of a policy on prompt/response pairs.

It shares the reward-model trainer's machinery (config tree, data checks, packing, engine, loop,
checkpoints, logging); only the data, the model head and the loss differ. The loss is the mean
next-token cross-entropy over response tokens of the whole optimizer step, so every TP/PP/DP
layout and micro-batch split computes the same number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_rlhf.checkpoint.model_ckpt import META_FILE, load_model_checkpoint, read_checkpoint_info
from megatron_rlhf.checkpoint.train_ckpt import CheckpointWriter
from megatron_rlhf.config.loader import BatchPlan, batch_plan, validate_sft_config
from megatron_rlhf.config.parallel import check_parallel_for_model, layout_of, model_options
from megatron_rlhf.config.schema import SFTConfig
from megatron_rlhf.convert.checkpoints import read_hf_arch
from megatron_rlhf.checkpoint.hf_io import HFReader
from megatron_rlhf.convert.weights import load_hf_weights
from megatron_rlhf.data.chat import pad_id
from megatron_rlhf.data.sft import SFTSample, load_samples, sft_batch
from megatron_rlhf.distributed.launch import discover_rank, init_distributed
from megatron_rlhf.distributed.layout import ParallelGroups, ParallelLayout, build_parallel_groups
from megatron_rlhf.errors import UserError
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.forward import pipeline_forward, token_cross_entropy
from megatron_rlhf.models.hf_config import padded_vocab_size
from megatron_rlhf.trainers.engine import (add_adapters, make_trainable, packing_supported,
                                          reduce_metrics, training_dtype)
from megatron_rlhf.trainers.loop import Run, epoch_order, run_job

METRIC_KEYS = ["loss", "target_tokens", "count", "tokens"]


@dataclass
class SFTData:
    config: SFTConfig
    groups: ParallelGroups
    plan: BatchPlan
    train: list[SFTSample]
    val: list[SFTSample]
    pad_id: int
    steps_per_epoch: int

    def batch(self, samples: list[SFTSample], loss_scale: float) -> dict:
        data = self.config.data
        return sft_batch(samples, data.max_prompt_length + data.max_response_length, self.pad_id,
                         data.use_remove_padding, loss_scale)


def sft_loss(logits: torch.Tensor, batch: dict, vocab_size: int, groups: ParallelGroups):
    """``logits [b, t, V/tp]`` from the last stage -> (this rank's loss share, metric sums)."""
    rows, length = logits.shape[:2]
    mask = batch["loss_mask"][:rows, :length].to(logits.device)
    per_token = token_cross_entropy(logits, batch["targets"][:rows, :length], vocab_size, groups)
    loss_sum = (per_token * mask).sum()
    metrics = {"loss": loss_sum.detach(), "target_tokens": mask.sum(),
               "count": torch.tensor(float(batch["count"])),
               "tokens": torch.tensor(float(batch["num_tokens"]))}
    return loss_sum * batch["loss_scale"], metrics


def summarize(sums: dict[str, float], prefix: str) -> dict[str, float]:
    loss = sums["loss"] / max(sums["target_tokens"], 1.0)
    return {f"{prefix}/loss": loss, f"{prefix}/perplexity": math.exp(min(loss, 50.0))}


def step_micro_batches(data: SFTData, step: int) -> list[dict]:
    plan, groups = data.plan, data.groups
    epoch, index = divmod(step, data.steps_per_epoch)
    order = epoch_order(len(data.train), data.config.trainer.seed, epoch, data.config.data.shuffle)
    step_samples = [data.train[i] for i in order[index * plan.per_step:
                                                 (index + 1) * plan.per_step]]
    # Megatron averages over micro-batches and DDP over ranks; undo both, divide by the step's
    # response tokens: the exact per-token mean of the whole step, whatever the layout.
    targets = sum(s.target_tokens for s in step_samples)
    scale = plan.micro_batches_per_step * groups.layout.dp / targets
    start = groups.dp_rank * plan.per_rank_step
    mine = step_samples[start:start + plan.per_rank_step]
    size = plan.per_micro_batch
    return [data.batch(mine[i:i + size], scale) for i in range(0, len(mine), size)]


@torch.no_grad()
def evaluate(data: SFTData, model, vocab_size: int) -> dict[str, float]:
    mine = data.val[data.groups.dp_rank::data.groups.layout.dp]
    size, chunk, outputs = data.plan.per_micro_batch, 8, []
    for start in range(0, len(mine), size * chunk):
        part = mine[start:start + size * chunk]
        batches = [data.batch(part[i:i + size], 1.0) for i in range(0, len(part), size)]
        outputs += pipeline_forward(
            model, data.groups, batches, lambda out, b: sft_loss(out, b, vocab_size, data.groups)[1])
    return summarize(reduce_metrics(outputs, data.groups, METRIC_KEYS), "val")


def _policy(path: str, layout: ParallelLayout):
    """(arch, hf_dir, checkpoint or None, padded vocab) of ``model.path``."""
    if (Path(path) / META_FILE).is_file():
        info = read_checkpoint_info(path)
        if info.arch.kind != "policy":
            raise UserError(f"{path} holds a {info.arch.kind} checkpoint, not a policy")
        return info.arch, info.hf_dir, info, info.padded_vocab
    arch = read_hf_arch(path)
    if arch.kind != "policy":
        raise UserError(f"{path} is a {arch.kind} model; SFT needs a *ForCausalLM")
    return arch, Path(path), None, padded_vocab_size(arch.vocab_size, layout.tp)


def _tool_schemas(config: SFTConfig, tokenizer) -> list[dict] | None:
    """``data.tools``' schemas, checked as ``rollout.tools`` are (the template must carry them),
    so SFT traces render as the RL run's tool prompts will; None without tools."""
    from megatron_rlhf.agent_tools.render import check_template
    from megatron_rlhf.agent_tools.spec import load_tools, tool_schemas

    tools = load_tools(config.data.tools, key="data.tools")
    if not tools:
        return None
    check_template(tokenizer, tools, "auto")
    return tool_schemas(tools)


def _load(config: SFTConfig, tokenizer):
    data = config.data
    limits = dict(tokenizer=tokenizer, max_prompt=data.max_prompt_length,
                  max_response=data.max_response_length, overlong=data.overlong,
                  tools=_tool_schemas(config, tokenizer))
    train, report = load_samples(data.train_files, **limits)
    val = load_samples(data.val_files, **limits)[0] if data.val_files else []
    return train, val, report


def setup(config: SFTConfig) -> Run:
    from transformers import AutoConfig, AutoTokenizer

    validate_sft_config(config)
    layout = layout_of(config.parallel)
    arch, hf_dir, checkpoint, padded = _policy(config.model.path, layout)
    check_parallel_for_model("parallel", config.parallel, arch)
    layout.resolve(discover_rank().world_size, arch.shape)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    config.data.use_remove_padding = packing_supported(
        config.data.use_remove_padding, tag="sft")
    init_distributed()
    groups = build_parallel_groups(layout, arch.shape, seed=config.trainer.seed)
    plan = batch_plan(config.data.train_batch_size, config.data.micro_batch_size_per_rank,
                      groups.layout.dp)
    train, val, report = _load(config, tokenizer)
    steps_per_epoch = len(train) // plan.per_step
    if steps_per_epoch == 0:
        raise UserError(f"config: {len(train)} training samples are fewer than one step's "
                        f"data.train_batch_size={plan.per_step}")
    total = steps_per_epoch * config.trainer.total_epochs
    total = min(total, config.trainer.max_steps) if config.trainer.max_steps else total
    dtype = training_dtype(config.model.dtype)
    options = model_options(config.parallel, config.model.moe)
    if checkpoint is not None:
        model = load_model_checkpoint(checkpoint, groups, dtype, options)
    else:
        model = build_model(arch, groups, dtype, padded, options)
        load_hf_weights(model, HFReader(hf_dir), arch, groups, padded, progress=False)
    lora = add_adapters(model, config.model.lora, config.trainer.seed, "sft")
    trainable = make_trainable(model, groups, config.optim, total,
                               config.parallel.use_distributed_optimizer)
    hf_config = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    meta = {"kind": "policy", "family": arch.family, "padded_vocab": padded, **lora}
    checkpoints = CheckpointWriter(Path(config.trainer.output_dir) / "checkpoints", trainable,
                                   meta, hf_config, tokenizer, config.trainer.keep_last_n,
                                   config.trainer.async_save)
    data = SFTData(config, groups, plan, train, val, pad_id(tokenizer), steps_per_epoch)
    run = Run(
        name="sft", config=config, trainer=config.trainer, groups=groups, trainable=trainable, total_steps=total,
        micro_batches=lambda step: step_micro_batches(data, step),
        loss=lambda out, batch: sft_loss(out, batch, arch.vocab_size, groups),
        metric_keys=METRIC_KEYS, summarize=summarize,
        evaluate=(lambda: evaluate(data, trainable.module, arch.vocab_size)) if val else None,
        checkpoints=checkpoints,
        item="samples", shown=("train/loss",))
    run.log(f"train data: {report}")
    run.log(f"layout {groups.layout}; {plan.per_step} samples/step; {total} steps")
    return run


def train_sft(config: SFTConfig) -> dict[str, float]:
    validate_sft_config(config)
    return run_job("sft", config, setup)
