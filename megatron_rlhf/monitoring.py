"""Metrics to TensorBoard and a progress line with rate and ETA (rank 0 only)."""

from __future__ import annotations

import sys
import time
from pathlib import Path


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class MetricsLogger:
    """Scalars to TensorBoard (``kind="tensorboard"``) and a periodic console line."""

    def __init__(self, output_dir: str, kind: str, total_steps: int, enabled: bool,
                 start_step: int = 0):
        self.enabled = enabled
        self.total_steps = total_steps
        self.writer, self.log_dir = None, Path(output_dir) / "tensorboard"
        self.start, self.start_step = time.time(), start_step
        self.items = self.tokens = 0.0
        if enabled and kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            # On resume, drop points a killed run logged after its last checkpoint.
            self.writer = SummaryWriter(str(self.log_dir),
                                        purge_step=start_step + 1 if start_step else None)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)
            self.writer.flush()

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
