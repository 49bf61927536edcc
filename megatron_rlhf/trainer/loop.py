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

from megatron_rlhf.checkpoint.train_ckpt import complete_checkpoints, load_train_checkpoint
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


def _previous_runs(run: Run, metrics_file: Path) -> list[Path]:
    """Checkpoints to resume from, newest first; refuses to mix a new run into an old folder."""
    found = complete_checkpoints(Path(run.trainer.output_dir) / "checkpoints")
    if run.trainer.resume == "disable" and (found or metrics_file.is_file()):
        raise UserError(f"{run.trainer.output_dir} already holds a run; with "
                        "trainer.resume=disable choose an empty trainer.output_dir")
    return found[::-1] if run.trainer.resume == "auto" else []


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


def _resume(run: Run, metrics_file: Path) -> int:
    candidates = rank0_decides(_previous_runs(run, metrics_file) if dist.get_rank() == 0 else None)
    for checkpoint in candidates:
        try:  # every rank reads the same files, so every rank takes the same branch
            step = load_train_checkpoint(checkpoint, run.trainable)["step"]
        except UserError as err:
            # A damaged newest checkpoint (a disk filled mid-copy) should not cost the run:
            # the one before it resumes with a few steps redone.
            run.log(f"warning: {err}; trying the checkpoint before it")
            continue
        run.log(f"resumed from {checkpoint} (step {step})")
        if dist.get_rank() == 0 and metrics_file.is_file():
            trim_metrics_file(metrics_file, step)
        return step
    if candidates:
        raise UserError(f"no checkpoint under {candidates[0].parent} can be read; move them away "
                        "to start over, or point trainer.output_dir elsewhere")
    return 0


def _finish(run: Run, step: int, last: dict, logger: MetricsLogger) -> dict:
    """The final checkpoint, then the final validation: a crash in the latter loses no training."""
    out = Path(run.trainer.output_dir)
    found = complete_checkpoints(out / "checkpoints") if dist.get_rank() == 0 else []
    saved = rank0_decides(bool(found) and found[-1].name.endswith(f"{step:08d}"))
    final = (found[-1] if found else None) if saved else run.save(step)
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
    """The newest step's metrics (rank 0; the others never write them)."""
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
    step = _resume(run, metrics_file)
    finished = rank0_decides((out / "final_metrics.json").is_file())
    if step >= run.total_steps and finished:
        run.log(f"{out} already finished {step} steps; nothing to do")
        return {}
    logger = MetricsLogger(trainer.output_dir, trainer.logger, run.total_steps,
                           dist.get_rank() == 0, start_step=step)
    last = _last_logged(metrics_file)  # a run whose final validation failed has only that left
    while step < run.total_steps:
        result = train_step(run.trainable, run.micro_batches(step), run.loss)
        sums = reduce_metrics(result.metrics, run.groups, run.metric_keys)
        step += 1
        logger.count(sums["count"], sums["tokens"])
        last = {**run.summarize(sums, "train"), "train/lr": result.lr,
                "train/grad_norm": result.grad_norm}
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
            run.save(step)
    last = _finish(run, step, last, logger)
    logger.close()
    return last
