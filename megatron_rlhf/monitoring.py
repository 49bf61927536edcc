"""Metrics to TensorBoard and/or wandb, and a progress line with rate and ETA (rank 0 only)."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
import uuid
from pathlib import Path

from megatron_rlhf.errors import UserError

LOGGERS = ("console", "tensorboard", "wandb")
WANDB_STEP = "trainer/step"  # wandb's x-axis: its own step must only grow, ours rewinds


def logger_kinds(value, key: str = "trainer.logger") -> list[str]:
    """``trainer.logger`` as a list: one name, a list of names, or ``a,b``; :class:`UserError`
    naming ``key`` for an unknown name, or for ``wandb`` when the package is missing."""
    items = list(value) if isinstance(value, (list, tuple)) else str(value).split(",")
    kinds = [str(item).strip() for item in items if str(item).strip()]
    bad = [kind for kind in kinds if kind not in LOGGERS]
    if bad or not kinds:
        raise UserError(f"config: {key}={value!r} must be one of {', '.join(LOGGERS)} or a list "
                        f"of them, e.g. [console,tensorboard,wandb]")
    if "wandb" in kinds and importlib.util.find_spec("wandb") is None:
        raise UserError(f"config: {key}={value!r} asks for wandb, which is not installed "
                        "(pip install wandb, or the project's [wandb] extra)")
    return list(dict.fromkeys(kinds))


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class MetricsLogger:
    """Scalars to TensorBoard and/or wandb (``kind``: see :func:`logger_kinds`) and a periodic
    console line (always). wandb logs under ``output_dir/wandb``, offline unless ``WANDB_MODE``
    is set, into one run per output folder (its id is kept in ``output_dir/wandb/run_id``, so a
    resumed job continues it); points are plotted against ``trainer/step``, so a rollback's
    redone steps are logged again at their step (wandb cannot delete points)."""

    def __init__(self, output_dir: str, kind, total_steps: int, enabled: bool,
                 start_step: int = 0, kept: list[dict] | None = None):
        self.enabled = enabled
        self.total_steps = total_steps
        kinds = logger_kinds(kind)
        self.writer, self.log_dir = None, Path(output_dir) / "tensorboard"
        self.wandb = None
        self.start, self.start_step = time.time(), start_step
        self.items = self.tokens = 0.0
        if enabled and "tensorboard" in kinds:
            from torch.utils.tensorboard import SummaryWriter

            # A folder a killed run logged to: drop its points from the step resumed at (0: a
            # start over) on, since it may have logged more of that step after its checkpoint
            # (e.g. a final validation), then log again the rows of that step the checkpoint
            # had seen: ``kept``, the metrics file's rows.
            earlier = self.log_dir.is_dir() and any(self.log_dir.glob("events.*"))
            self.writer = SummaryWriter(str(self.log_dir),
                                        purge_step=start_step if earlier else None)
            for row in kept or []:
                if row["step"] == start_step:
                    self.scalars(start_step, {k: v for k, v in row.items() if k != "step"})
        if enabled and "wandb" in kinds:
            self.wandb = _start_wandb(Path(output_dir))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log({**values, WANDB_STEP: step})

    def rewind(self, step: int) -> None:
        """Hide the points logged after ``step`` (a rollback undid those steps)."""
        if self.writer is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer.close()
            self.writer = SummaryWriter(str(self.log_dir), purge_step=step + 1)

    def count(self, items: float, tokens: float) -> None:
        """Add one step's work to the rate counters (call every step)."""
        self.items += items
        self.tokens += tokens

    def progress(self, step: int, item_name: str, shown: dict[str, float]) -> dict[str, float]:
        """Print ``step k/N | metrics | items/s | tokens/s | ETA``; return the rates."""
        elapsed = time.time() - self.start
        done = step - self.start_step
        rates = {f"throughput/{item_name}_per_s": self.items / elapsed,
                 "throughput/tokens_per_s": self.tokens / elapsed}
        if self.enabled:
            eta = elapsed / done * (self.total_steps - step)
            fields = " | ".join(f"{k} {v:.4g}" for k, v in shown.items())
            print(f"step {step}/{self.total_steps} | {fields} | "
                  f"{rates[f'throughput/{item_name}_per_s']:.1f} {item_name}/s | "
                  f"{rates['throughput/tokens_per_s']:.0f} tok/s | ETA {_duration(eta)}",
                  file=sys.stdout, flush=True)
        return rates

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def _start_wandb(out: Path):
    import wandb

    folder = out / "wandb"
    folder.mkdir(parents=True, exist_ok=True)
    id_file = folder / "run_id"
    if not id_file.is_file():
        id_file.write_text(uuid.uuid4().hex[:12])
    run = wandb.init(project=os.environ.get("WANDB_PROJECT", "megatron_rlhf"), name=out.name,
                     id=id_file.read_text().strip(), resume="allow", dir=str(out),
                     mode=None if "WANDB_MODE" in os.environ else "offline")
    run.define_metric(WANDB_STEP)
    run.define_metric("*", step_metric=WANDB_STEP)
    return run
