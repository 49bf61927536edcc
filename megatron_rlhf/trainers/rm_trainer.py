"""`megatron-rlhf train-rm`: a Bradley-Terry reward model on Megatron-Core.

Chosen and rejected responses go through the model in the same forward pass (packed into shared
rows when ``data.use_remove_padding``); the reward is the value head at each sequence's last token.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rlhf.algorithms.bradley_terry import bradley_terry_loss, pair_metrics
from megatron_rlhf.checkpoint.train_ckpt import (complete_checkpoints, load_train_checkpoint,
                                                 save_train_checkpoint)
from megatron_rlhf.config.loader import BatchPlan, batch_plan, validate_rm_config
from megatron_rlhf.config.schema import RMConfig
from megatron_rlhf.data.packing import pack_sequences
from megatron_rlhf.data.preference import TokenizedPair, load_pairs
from megatron_rlhf.data.chat import pad_id
from megatron_rlhf.distributed.launch import discover_rank, init_distributed
from megatron_rlhf.distributed.layout import ParallelGroups, ParallelLayout, build_parallel_groups
from megatron_rlhf.distributed.platform import platform_is_cpu
from megatron_rlhf.errors import UserError
from megatron_rlhf.models.builder import uses_transformer_engine
from megatron_rlhf.models.forward import pipeline_forward
from megatron_rlhf.monitoring import MetricsLogger
from megatron_rlhf.trainers.engine import Trainable, make_trainable, reduce_metrics, train_step
from megatron_rlhf.trainers.value_init import (build_value_model, resolve_value_source,
                                               reward_model_hf_config)

METRIC_KEYS = ["loss", "correct", "margin", "chosen", "chosen_sq", "rejected", "rejected_sq",
               "count", "tokens"]


@dataclass
class RMRun:
    """Everything the loop needs, built once at start-up."""

    config: RMConfig
    groups: ParallelGroups
    plan: BatchPlan
    trainable: Trainable
    train_pairs: list[TokenizedPair]
    val_pairs: list[TokenizedPair]
    pad_id: int
    total_steps: int
    steps_per_epoch: int
    save: callable


def pair_batch(pairs: list[TokenizedPair], config: RMConfig, pad_id: int) -> dict:
    """Both sides of every pair in one batch: sequence ``2i`` is chosen, ``2i + 1`` rejected."""
    data = config.data
    sequences = [list(side) for p in pairs for side in (p.chosen, p.rejected)]
    packed = pack_sequences(sequences, data.max_prompt_length + data.max_response_length, pad_id,
                            data.use_remove_padding)
    return {"input_ids": packed.input_ids, "attention_mask": packed.attention_mask,
            "last_index": packed.last_index, "num_tokens": packed.num_tokens,
            "margin": torch.tensor([p.margin for p in pairs])}


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
    return losses.mean(), metrics


def summarize(sums: dict[str, float], prefix: str) -> dict[str, float]:
    n = max(sums["count"], 1.0)
    out = {f"{prefix}/loss": sums["loss"] / n, f"{prefix}/accuracy": sums["correct"] / n,
           f"{prefix}/margin_mean": sums["margin"] / n}
    for side in ("chosen", "rejected"):
        mean = sums[side] / n
        out[f"{prefix}/{side}_reward_mean"] = mean
        out[f"{prefix}/{side}_reward_std"] = math.sqrt(max(sums[f"{side}_sq"] / n - mean ** 2, 0.0))
    return out


def epoch_order(count: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(count))
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed * 100003 + epoch)).tolist()


def step_micro_batches(run: RMRun, step: int) -> list[dict]:
    """This rank's micro-batches for global optimizer step ``step`` (0-based)."""
    plan, groups = run.plan, run.groups
    epoch, index = divmod(step, run.steps_per_epoch)
    order = epoch_order(len(run.train_pairs), run.config.trainer.seed, epoch, run.config.data.shuffle)
    start = index * plan.pairs_per_step + groups.dp_rank * plan.pairs_per_rank_step
    mine = [run.train_pairs[i] for i in order[start:start + plan.pairs_per_rank_step]]
    return [pair_batch(mine[i:i + plan.micro_batch_pairs], run.config, run.pad_id)
            for i in range(0, len(mine), plan.micro_batch_pairs)]


@torch.no_grad()
def evaluate(run: RMRun) -> dict[str, float]:
    groups = run.groups
    mine = run.val_pairs[groups.dp_rank::groups.layout.dp]
    size, chunk = run.plan.micro_batch_pairs, 8  # micro-batches (and masks) alive at a time
    outputs = []
    for start in range(0, len(mine), size * chunk):
        part = mine[start:start + size * chunk]
        batches = [pair_batch(part[i:i + size], run.config, run.pad_id)
                   for i in range(0, len(part), size)]
        outputs += pipeline_forward(run.trainable.module, groups, batches,
                                    lambda out, batch: rm_loss(out, batch, run.config)[1])
    return summarize(reduce_metrics(outputs, groups, METRIC_KEYS), "val")


def _dtype(config: RMConfig) -> torch.dtype:
    name = config.model.dtype
    if name == "auto":
        return torch.float32 if platform_is_cpu() else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


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


def setup(config: RMConfig) -> RMRun:
    """Validate, read data (before any model is built), build model, optimizer and schedule."""
    from transformers import AutoTokenizer

    validate_rm_config(config)
    layout = ParallelLayout(tp=config.parallel.tp, pp=config.parallel.pp)
    source = resolve_value_source(config.model.path, layout)
    layout.resolve(discover_rank().world_size, source.arch.shape)  # before any group exists
    tokenizer = AutoTokenizer.from_pretrained(source.hf_dir, local_files_only=True)
    if config.data.use_remove_padding and uses_transformer_engine():
        # TE's causal kernels ignore our block-diagonal mask; packed THD inputs are not wired up.
        _log("[train-rm] data.use_remove_padding is not supported with Transformer Engine yet: "
             "padding instead")
        config.data.use_remove_padding = False
    init_distributed()
    groups = build_parallel_groups(layout, source.arch.shape, seed=config.trainer.seed)
    plan = batch_plan(config.data.train_batch_size, config.data.micro_batch_size_per_rank,
                      groups.layout.dp)
    train, val = _load_data(config, tokenizer)
    steps_per_epoch = len(train) // plan.pairs_per_step
    if steps_per_epoch == 0:
        raise UserError(f"config: {len(train)} training pairs are fewer than one step's "
                        f"data.train_batch_size={plan.pairs_per_step}")
    total = steps_per_epoch * config.trainer.total_epochs
    if config.trainer.max_steps:
        total = min(total, config.trainer.max_steps)
    model = build_value_model(source, groups, _dtype(config), config.trainer.seed)
    trainable = make_trainable(model, groups, config.optim, total)
    hf_config = reward_model_hf_config(source, pad_id(tokenizer))
    meta = {"kind": "value", "family": source.arch.family, "padded_vocab": source.padded_vocab}
    root = Path(config.trainer.output_dir) / "checkpoints"

    def save(step: int) -> Path:
        return save_train_checkpoint(root, step, trainable, meta, hf_config, tokenizer,
                                     {"step": step}, config.trainer.keep_last_n)

    _log(f"[train-rm] layout {groups.layout}; {plan.pairs_per_step} pairs/step = "
         f"{groups.layout.dp} ranks x {plan.micro_batches_per_step} micro-batches x "
         f"{plan.micro_batch_pairs} pairs; {total} steps")
    return RMRun(config, groups, plan, trainable, train, val, pad_id(tokenizer), total,
                 steps_per_epoch, save)


def _rank0_decides(value):
    """Rank 0's ``value`` on every rank: filesystem views may differ between nodes, and every
    rank must take the same branch into collective loads and saves."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _previous_run(run: RMRun, metrics_file: Path) -> Path | None:
    """The checkpoint to resume from, or None; refuses to mix a new run into an old folder."""
    root = Path(run.config.trainer.output_dir) / "checkpoints"
    found = complete_checkpoints(root)
    if run.config.trainer.resume == "disable" and (found or metrics_file.is_file()):
        raise UserError(f"{run.config.trainer.output_dir} already holds a run; with "
                        "trainer.resume=disable choose an empty trainer.output_dir")
    return found[-1] if found and run.config.trainer.resume == "auto" else None


def _trim_metrics(metrics_file: Path, step: int) -> None:
    """Keep the lines up to ``step``; a line half-written by a killed run is dropped."""
    kept = []
    for line in metrics_file.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError):
            continue
    metrics_file.write_text("".join(line + "\n" for line in kept))


def _resume(run: RMRun, metrics_file: Path) -> int:
    checkpoint = _rank0_decides(_previous_run(run, metrics_file) if dist.get_rank() == 0 else None)
    if checkpoint is None:
        return 0
    step = load_train_checkpoint(checkpoint, run.trainable)["step"]
    _log(f"[train-rm] resumed from {checkpoint} (step {step})")
    if dist.get_rank() == 0 and metrics_file.is_file():
        _trim_metrics(metrics_file, step)
    return step


def _finish(run: RMRun, step: int, last: dict, logger: MetricsLogger) -> dict:
    out = Path(run.config.trainer.output_dir)
    if run.val_pairs:
        last.update(evaluate(run))
        logger.scalars(step, last)
        _log("[train-rm] validation: " + ", ".join(f"{k.split('/')[1]} {v:.4f}"
                                                   for k, v in last.items() if k.startswith("val/")))
    if dist.get_rank() == 0:
        (out / "final_metrics.json").write_text(json.dumps({"step": step, **last}, indent=2))
    found = complete_checkpoints(out / "checkpoints") if dist.get_rank() == 0 else []
    saved = _rank0_decides(bool(found) and found[-1].name.endswith(f"{step:08d}"))
    final = (found[-1] if found else None) if saved else run.save(step)
    _log(f"[train-rm] final checkpoint {final} (export: megatron-rlhf convert mcore-to-hf "
         f"--mcore-dir {final} --out-dir HF_DIR)")
    return last


def train_rm(config: RMConfig) -> dict[str, float]:
    """The loop: batches -> forward/backward -> optimizer step -> log / validate / save."""
    run = setup(config)
    trainer = config.trainer
    out = Path(trainer.output_dir)
    metrics_file = out / "metrics.jsonl"
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    step = _resume(run, metrics_file)
    if step >= run.total_steps:
        _log(f"[train-rm] {out} already finished {step} steps; nothing to do")
        return {}
    logger = MetricsLogger(trainer.output_dir, trainer.logger, run.total_steps,
                           dist.get_rank() == 0, start_step=step)
    last = {}
    while step < run.total_steps:
        result = train_step(run.trainable, step_micro_batches(run, step),
                            lambda output, batch: rm_loss(output, batch, config))
        sums = reduce_metrics(result.metrics, run.groups, METRIC_KEYS)
        step += 1
        logger.count(sums["count"], sums["tokens"])
        last = {**summarize(sums, "train"), "train/lr": result.lr, "train/grad_norm": result.grad_norm}
        if not math.isfinite(last["train/loss"]):
            raise UserError(f"training loss is {last['train/loss']} at step {step}; stopped without "
                            f"saving (checkpoints in {out / 'checkpoints'} are untouched)")
        if trainer.eval_every_steps and step % trainer.eval_every_steps == 0 and run.val_pairs:
            last.update(evaluate(run))
        if step % trainer.log_every_steps == 0 or step == run.total_steps:
            shown = {"loss": last["train/loss"], "acc": last["train/accuracy"], "lr": result.lr}
            last.update(logger.progress(step, "pairs", shown))
        logger.scalars(step, last)
        if dist.get_rank() == 0:
            with metrics_file.open("a") as handle:
                handle.write(json.dumps({"step": step, **last}) + "\n")
        if trainer.save_every_steps and step % trainer.save_every_steps == 0:
            run.save(step)
    last = _finish(run, step, last, logger)
    logger.close()
    return last
