"""The supervised training loop every trainer shares (reward model, SFT): resume, step, log,
validate, save, stop. A trainer supplies its batches, its loss and its metrics through :class:`Run`.

A run killed at any moment and relaunched with the same command ends as if never interrupted:
it resumes from its newest complete checkpoint, whose ``metrics_rows`` says how many rows of
``metrics.jsonl`` it had seen (the rest, and TensorBoard's points from that step on, are
replaced). A stop signal or ``trainer.stop_at`` ends it at a step boundary with a checkpoint
(exit code 75), and a finished run relaunched does nothing (``finished.json``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megatron_rlhf.checkpoint.safe_load import RefusedCheckpointFile
from megatron_rlhf.checkpoint.train_ckpt import (CheckpointWriter, complete_checkpoints,
                                                  load_train_checkpoint, read_checkpoint_files,
                                                  remove_unfinished)
from megatron_rlhf.config.schema import TrainerConfig
from megatron_rlhf.distributed.layout import ParallelGroups
from megatron_rlhf.distributed.platform import device
from megatron_rlhf.errors import RunStopped, UserError
from megatron_rlhf.monitoring import MetricsLogger
from megatron_rlhf.trainers.engine import Trainable, reduce_metrics, train_step
from megatron_rlhf.trainers.lifecycle import MetricsFile, StopRequest, finished, mark_finished


@dataclass
class Run:
    """Everything the loop needs, built once at start-up by a trainer."""

    name: str  # "train-rm", "sft": log prefix
    config: object  # the trainer's whole config (finished marker, run fingerprint)
    trainer: TrainerConfig
    groups: ParallelGroups
    trainable: Trainable
    total_steps: int
    micro_batches: Callable[[int], list[dict]]  # global step -> this rank's micro-batches
    loss: Callable  # (last-stage output, batch) -> (mean loss, metric sums)
    metric_keys: list[str]  # sums reduced over ranks; must include "count" and "tokens"
    summarize: Callable[[dict, str], dict]  # (sums, "train"|"val") -> scalars
    evaluate: Callable[[], dict] | None  # -> "val/..." scalars
    checkpoints: CheckpointWriter
    item: str  # what "count" counts: "pairs", "samples"
    shown: tuple[str, ...]  # train scalars on the progress line
    logger: MetricsLogger | None = None  # opened by fit, after the resume

    def log(self, message: str) -> None:
        if dist.get_rank() == 0:
            print(f"[{self.name}] {message}", flush=True)

    def save(self, step: int, metrics: MetricsFile) -> Path:
        """Checkpoint ``step`` (rank 0 counts the rows logged before it)."""
        rows = metrics.rows() if dist.get_rank() == 0 else 0
        path = self.checkpoints.save(step, {"step": step, "metrics_rows": rows})
        self.log(f"checkpoint {path.name} {'handed to the writer' if self.checkpoints.pending else 'saved'} "
                 f"in {self.checkpoints.seconds:.1f} s")
        return path


def run_job(name: str, config, setup: Callable[[object], Run]) -> dict[str, float]:
    """A supervised job from its validated config: nothing when it already finished; else the
    stop signals caught from before the (long) set-up until the job returns."""
    if already_finished(name, config):
        return {}
    stop = StopRequest(config.trainer, name).install()
    try:
        return fit(setup(config), stop)
    finally:
        stop.uninstall()  # the signals' own handlers again (a caller running several jobs)


def already_finished(name: str, config) -> bool:
    """A run whose ``finished.json`` matches ``config``: one line, and nothing else to do."""
    from megatron_rlhf.distributed.launch import discover_rank

    if config.trainer.resume != "auto":
        return False  # "disable" refuses a used folder, after the usual checks
    step = finished(config.trainer.output_dir, config)
    if step is not None and discover_rank().rank == 0:
        print(f"[{name}] {config.trainer.output_dir} already finished {step} steps "
              f"({config.trainer.output_dir}/finished.json); nothing to do", flush=True)
    return step is not None


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


def _previous_runs(run: Run, metrics: MetricsFile) -> list[Path] | str:
    """Checkpoints to resume from, newest first, or why this folder must not be used."""
    found = complete_checkpoints(Path(run.trainer.output_dir) / "checkpoints")
    if run.trainer.resume == "disable" and (found or metrics.exists()):
        return (f"{run.trainer.output_dir} already holds a run; with trainer.resume=disable "
                "choose an empty trainer.output_dir")
    return found[::-1] if run.trainer.resume == "auto" else []


def _agreed_error(error: Exception | None) -> tuple[str, bool] | None:
    """The first rank's error and whether it refused a planted file, on every rank: all of
    them fall back together, or none."""
    errors = [None] * dist.get_world_size()
    mine = None if error is None else (str(error), isinstance(error, RefusedCheckpointFile))
    dist.all_gather_object(errors, mine)
    return next((e for e in errors if e is not None), None)


def _load_agreed(checkpoint: Path, run: Run) -> tuple[dict | None, tuple[str, bool] | None]:
    """(trainer state, None) when every rank loaded ``checkpoint``, else (None, the first
    rank's error). Each stage ends in an agreement, so no rank enters a collective the others
    skip."""
    files, error = None, None
    try:
        files = read_checkpoint_files(checkpoint)
    except UserError as err:
        error = err
    if (agreed := _agreed_error(error)) is not None:
        return None, agreed
    state = None
    try:
        state = load_train_checkpoint(checkpoint, run.trainable, files)
    except UserError as err:
        error = err
    agreed = _agreed_error(error)
    return (state, None) if agreed is None else (None, agreed)


def _resume(run: Run, metrics: MetricsFile) -> tuple[int, Path | None, list[dict]]:
    """(step, checkpoint, the metrics rows it had seen) to continue from; (0, None, []) for a
    fresh start."""
    rank0 = dist.get_rank() == 0
    if rank0:
        left = remove_unfinished(Path(run.trainer.output_dir) / "checkpoints")
        if left:
            run.log(f"removed {len(left)} unfinished checkpoint folder(s) of a killed save")
    candidates = rank0_decides(_previous_runs(run, metrics) if rank0 else None)
    if isinstance(candidates, str):
        raise UserError(candidates)
    newest_error = None
    for checkpoint in candidates:
        state, error = _load_agreed(checkpoint, run)
        if error is not None and error[1]:
            raise UserError(error[0])  # planted, not damaged: nothing else is trusted either
        if error is not None:
            # A damaged newest checkpoint (a disk filled mid-copy) should not cost the run:
            # the one before it resumes with a few steps redone.
            run.log(f"warning: {error[0]}; trying the checkpoint before it")
            newest_error = newest_error or error[0]
            continue
        step = state["step"]
        run.log(f"resumed from {checkpoint} (step {step})")
        kept = metrics.trim(step, state.get("metrics_rows")) if rank0 and metrics.exists() else []
        return step, checkpoint, kept
    if candidates:
        raise UserError(f"no checkpoint under {candidates[0].parent} can be read (newest: "
                        f"{newest_error}); move them away to start over, or point "
                        "trainer.output_dir elsewhere")
    if rank0 and metrics.exists():
        metrics.trim(0, rows=0)  # lines of a run killed before its first save
    return 0, None, []


def _agreed_stop(stop: StopRequest) -> str | None:
    """Every rank's view of ``stop`` combined (a signal may reach one rank only, clocks
    differ): every rank stops at this boundary, or none does."""
    mine = stop.reason()
    code = 0 if mine is None else 2 if stop.received else 1
    flag = torch.tensor([code], dtype=torch.int32, device=device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    agreed = int(flag.item())
    if agreed == 0:
        return None
    if agreed == code:
        return mine
    return "a stop signal on another rank" if agreed == 2 else "trainer.stop_at on another rank"


def _finish(run: Run, step: int, saved: tuple[int, Path | None], last: dict,
            logger: MetricsLogger, metrics: MetricsFile) -> tuple[dict, Path]:
    """The final checkpoint, then the final validation: a crash in the latter loses no training;
    returns the last scalars and the final checkpoint. ``saved``: the newest checkpoint this process wrote or read, and its step; a folder's name
    alone is no proof (it may be the damaged one a resume skipped)."""
    out = Path(run.trainer.output_dir)
    final = saved[1] if saved[0] == step and saved[1] is not None else run.save(step, metrics)
    run.checkpoints.close()
    run.log(f"final checkpoint {final} (export: megatron-rlhf convert mcore-to-hf "
            f"--mcore-dir {final} --out-dir HF_DIR)")
    if run.evaluate is not None:
        last.update(run.evaluate())
        logger.scalars(step, last)
        run.log("validation: " + ", ".join(f"{k.split('/')[1]} {v:.4f}"
                                           for k, v in last.items() if k.startswith("val/")))
    if dist.get_rank() == 0:
        (out / "final_metrics.json").write_text(json.dumps({"step": step, **last}, indent=2))
    return last, final


def _stop(run: Run, step: int, saved: tuple[int, Path | None], reason: str,
          metrics: MetricsFile) -> RunStopped:
    """Checkpoint this step (unless just saved), commit it, and say how to go on."""
    path = saved[1] if saved[0] == step and saved[1] is not None else run.save(step, metrics)
    run.checkpoints.close()
    return RunStopped(step, reason, str(path))


def _train_one(run: Run, step: int) -> dict:
    """One optimizer step (global ``step``, 0-based): the scalars of the step."""
    result = train_step(run.trainable, run.micro_batches(step), run.loss)
    sums = reduce_metrics(result.metrics, run.groups, run.metric_keys)
    run.logger.count(sums["count"], sums["tokens"])
    last = {**run.summarize(sums, "train"), "train/lr": result.lr,
            "train/grad_norm": result.grad_norm, **result.moe}
    if not math.isfinite(last["train/loss"]):
        run.checkpoints.close()  # a save in flight is of a good step: let it land
        raise UserError(f"training loss is {last['train/loss']} at step {step + 1}; stopped "
                        f"without saving (checkpoints in {Path(run.trainer.output_dir) / 'checkpoints'} "
                        "are untouched)")
    t = run.trainer
    if t.eval_every_steps and (step + 1) % t.eval_every_steps == 0 and run.evaluate:
        last.update(run.evaluate())
    if (step + 1) % t.log_every_steps == 0 or step + 1 == run.total_steps:
        shown = {name.split("/")[-1]: last[name] for name in run.shown}
        last.update(run.logger.progress(step + 1, run.item, {**shown, "lr": result.lr}))
    return last


def fit(run: Run, stop: StopRequest | None = None) -> dict[str, float]:
    """batches -> forward/backward -> optimizer step -> log / validate / save, until the end or
    a stop (:class:`~megatron_rlhf.errors.RunStopped` after a checkpoint)."""
    trainer = run.trainer
    out = Path(trainer.output_dir)
    metrics = MetricsFile(out / "metrics.jsonl")
    stop = stop or StopRequest(trainer, run.name).install()
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    step, checkpoint, kept = _resume(run, metrics)
    saved = (step, checkpoint)
    if step >= run.total_steps and rank0_decides((out / "final_metrics.json").is_file()):
        run.log(f"{out} already finished {step} steps; nothing to do")
        if dist.get_rank() == 0:
            mark_finished(out, run.config, step, [checkpoint, out / "final_metrics.json",
                                                  metrics.path])
        return {}
    run.logger = MetricsLogger(trainer.output_dir, trainer.logger, run.total_steps,
                               dist.get_rank() == 0, start_step=step, kept=kept)
    # A run whose final validation failed has only that left to do, with the metrics it logged.
    last = {k: v for k, v in kept[-1].items() if k != "step"} if kept and step >= run.total_steps else {}
    try:
        while step < run.total_steps:
            started = time.perf_counter()
            last = _train_one(run, step)
            step += 1
            run.logger.scalars(step, last)
            if dist.get_rank() == 0:
                metrics.append({"step": step, **last})
            stop.observe(step_s=time.perf_counter() - started)
            if trainer.save_every_steps and step % trainer.save_every_steps == 0:
                saved = (step, run.save(step, metrics))
                stop.observe(save_s=run.checkpoints.seconds)
            for done, seconds in run.checkpoints.finalize():
                if run.checkpoints.async_save:
                    run.log(f"checkpoint step {done} committed, {seconds:.1f} s after it started")
            reason = _agreed_stop(stop) if step < run.total_steps else None
            if reason is not None:
                raise _stop(run, step, saved, reason, metrics)
        last, final = _finish(run, step, saved, last, run.logger, metrics)
    finally:
        run.logger.close()
    if dist.get_rank() == 0:
        mark_finished(out, run.config, step, [final, out / "final_metrics.json", metrics.path])
    return last
