"""The supervised training loop every trainer shares (reward model, SFT): resume, step, log,
validate, save. A trainer supplies its batches, its loss and its metrics through :class:`Run`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megatron_rlhf.checkpoint.train_ckpt import (complete_checkpoints, load_train_checkpoint,
                                                  read_checkpoint_files)
from megatron_rlhf.config.schema import TrainerConfig
from megatron_rlhf.distributed.layout import ParallelGroups
from megatron_rlhf.errors import UserError
from megatron_rlhf.monitoring import MetricsLogger
from megatron_rlhf.trainer.engine import Trainable, reduce_metrics, train_step


@dataclass
class Run:
    """Everything the loop needs, built once at start-up by a trainer."""

    name: str  # "train-rm", "sft": log prefix
    trainer: TrainerConfig
    groups: ParallelGroups
    trainable: Trainable
    total_steps: int
    micro_batches: Callable[[int], list[dict]]  # global step -> this rank's micro-batches
    loss: Callable  # (last-stage output, batch) -> (mean loss, metric sums)
    metric_keys: list[str]  # sums reduced over ranks; must include "count" and "tokens"
    summarize: Callable[[dict, str], dict]  # (sums, "train"|"val") -> scalars
    evaluate: Callable[[], dict] | None  # -> "val/..." scalars
    save: Callable[[int], Path]
    item: str  # what "count" counts: "pairs", "samples"
    shown: tuple[str, ...]  # train scalars on the progress line

    def log(self, message: str) -> None:
        if dist.get_rank() == 0:
            print(f"[{self.name}] {message}", flush=True)


def epoch_order(count: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The order examples are visited in ``epoch``: the same on every rank, every run."""
    if not shuffle:
        return list(range(count))
    generator = torch.Generator().manual_seed(seed * 100003 + epoch)
    return torch.randperm(count, generator=generator).tolist()


def rank0_decides(value):
    """Rank 0's ``value`` on every rank: filesystem views may differ between nodes, and every
    rank must take the same branch into collective loads and saves."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _previous_runs(run: Run, metrics_file: Path) -> list[Path] | str:
    """Checkpoints to resume from, newest first, or why this folder must not be used."""
    found = complete_checkpoints(Path(run.trainer.output_dir) / "checkpoints")
    if run.trainer.resume == "disable" and (found or metrics_file.is_file()):
        return (f"{run.trainer.output_dir} already holds a run; with trainer.resume=disable "
                "choose an empty trainer.output_dir")
    return found[::-1] if run.trainer.resume == "auto" else []


def _agreed_error(error: Exception | None) -> str | None:
    """The first rank's error, on every rank: all of them fall back together, or none."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else str(error))
    return next((e for e in errors if e is not None), None)


def trim_metrics_file(metrics_file: Path, step: int) -> None:
    """Keep the lines up to ``step``; a line half-written by a killed run is dropped."""
    kept = []
    for line in metrics_file.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError):
            continue
    metrics_file.write_text("".join(line + "\n" for line in kept))


def _load_agreed(checkpoint: Path, run: Run) -> tuple[int | None, str | None]:
    """(step, None) when every rank loaded ``checkpoint``, else (None, the first rank's error).
    Each stage ends in an agreement, so no rank enters a collective the others skip."""
    files, error = None, None
    try:
        files = read_checkpoint_files(checkpoint)
    except UserError as err:
        error = err
    if (error := _agreed_error(error)) is not None:
        return None, error
    step = None
    try:
        step = load_train_checkpoint(checkpoint, run.trainable, files)["step"]
    except UserError as err:
        error = err
    error = _agreed_error(error)
    return (step, None) if error is None else (None, error)


def _resume(run: Run, metrics_file: Path) -> tuple[int, Path | None]:
    """(step, checkpoint) to continue from; (0, None) for a fresh start."""
    candidates = rank0_decides(_previous_runs(run, metrics_file) if dist.get_rank() == 0 else None)
    if isinstance(candidates, str):
        raise UserError(candidates)
    newest_error = None
    for checkpoint in candidates:
        step, error = _load_agreed(checkpoint, run)
        if error is not None:
            # A damaged newest checkpoint (a disk filled mid-copy) should not cost the run:
            # the one before it resumes with a few steps redone.
            run.log(f"warning: {error}; trying the checkpoint before it")
            newest_error = newest_error or error
            continue
        run.log(f"resumed from {checkpoint} (step {step})")
        if dist.get_rank() == 0 and metrics_file.is_file():
            trim_metrics_file(metrics_file, step)
        return step, checkpoint
    if candidates:
        raise UserError(f"no checkpoint under {candidates[0].parent} can be read (newest: "
                        f"{newest_error}); move them away to start over, or point "
                        "trainer.output_dir elsewhere")
    if dist.get_rank() == 0 and metrics_file.is_file():
        trim_metrics_file(metrics_file, 0)  # lines of a run killed before its first save
    return 0, None


def _finish(run: Run, step: int, saved: tuple[int, Path | None], last: dict,
            logger: MetricsLogger) -> dict:
    """The final checkpoint, then the final validation: a crash in the latter loses no training.
    ``saved``: the newest checkpoint this process wrote or read, and its step; a folder's name
    alone is no proof (it may be the damaged one a resume skipped)."""
    out = Path(run.trainer.output_dir)
    final = saved[1] if saved[0] == step and saved[1] is not None else run.save(step)
    run.log(f"final checkpoint {final} (export: megatron-rlhf convert mcore-to-hf "
            f"--mcore-dir {final} --out-dir HF_DIR)")
    if run.evaluate is not None:
        last.update(run.evaluate())
        logger.scalars(step, last)
        run.log("validation: " + ", ".join(f"{k.split('/')[1]} {v:.4f}"
                                           for k, v in last.items() if k.startswith("val/")))
    if dist.get_rank() == 0:
        (out / "final_metrics.json").write_text(json.dumps({"step": step, **last}, indent=2))
    return last


def _last_logged(metrics_file: Path) -> dict:
    """The newest step's metrics (rank 0; the others never write them). The file was trimmed
    on resume, so every line parses."""
    if dist.get_rank() != 0 or not metrics_file.is_file():
        return {}
    lines = metrics_file.read_text().splitlines()
    return {k: v for k, v in json.loads(lines[-1]).items() if k != "step"} if lines else {}


def fit(run: Run) -> dict[str, float]:
    """batches -> forward/backward -> optimizer step -> log / validate / save, until the end."""
    trainer = run.trainer
    out = Path(trainer.output_dir)
    metrics_file = out / "metrics.jsonl"
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    step, checkpoint = _resume(run, metrics_file)
    saved = (step, checkpoint)
    finished = rank0_decides((out / "final_metrics.json").is_file())
    if step >= run.total_steps and finished:
        run.log(f"{out} already finished {step} steps; nothing to do")
        return {}
    logger = MetricsLogger(trainer.output_dir, trainer.logger, run.total_steps,
                           dist.get_rank() == 0, start_step=step)
    # A run whose final validation failed has only that left to do, with the metrics it logged.
    last = _last_logged(metrics_file) if step >= run.total_steps else {}
    while step < run.total_steps:
        result = train_step(run.trainable, run.micro_batches(step), run.loss)
        sums = reduce_metrics(result.metrics, run.groups, run.metric_keys)
        step += 1
        logger.count(sums["count"], sums["tokens"])
        last = {**run.summarize(sums, "train"), "train/lr": result.lr,
                "train/grad_norm": result.grad_norm, **result.moe}
        if not math.isfinite(last["train/loss"]):
            raise UserError(f"training loss is {last['train/loss']} at step {step}; stopped without "
                            f"saving (checkpoints in {out / 'checkpoints'} are untouched)")
        if trainer.eval_every_steps and step % trainer.eval_every_steps == 0 and run.evaluate:
            last.update(run.evaluate())
        if step % trainer.log_every_steps == 0 or step == run.total_steps:
            shown = {name.split("/")[-1]: last[name] for name in run.shown}
            last.update(logger.progress(step, run.item, {**shown, "lr": result.lr}))
        logger.scalars(step, last)
        if dist.get_rank() == 0:
            with metrics_file.open("a") as handle:
                handle.write(json.dumps({"step": step, **last}) + "\n")
        if trainer.save_every_steps and step % trainer.save_every_steps == 0:
            saved = (step, run.save(step))
    last = _finish(run, step, saved, last, logger)
    logger.close()
    return last
