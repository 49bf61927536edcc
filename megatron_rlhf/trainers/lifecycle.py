"""How a run ends and starts again: a clean stop on a signal or a deadline, the finished marker,
and a metrics file whose rows a resume cuts back to exactly what its checkpoint had seen.

A clean stop happens at a step boundary: every process that decides (the ranks of a
supervised run, which agree through one collective; the PPO driver, which also asks its
workers) sees the same reason, a checkpoint of that step is written, the loggers are flushed
and the run raises :class:`~megatron_rlhf.errors.RunStopped` (exit code 75).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from megatron_rlhf.config.stopping import stop_deadline, stop_signals

FINISHED_FILE = "finished.json"


# A stop signal that arrived before any run installed its StopRequest (see catch_early).
_EARLY: dict = {"received": None}
EARLY_SIGNALS = ("SIGUSR1", "SIGUSR2")


def catch_early() -> dict:
    """From the first line of ``main``: a stop signal arriving while the job imports and sets
    up (a Slurm time-limit signal can come at any moment, and Python's default for SIGUSR1 is to
    die) is kept for the run's :class:`StopRequest` instead. Returns the handlers it replaced;
    outside the main thread (an in-process caller's worker thread) it does nothing."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}

    def caught(signum, _frame):
        _EARLY["received"] = _EARLY["received"] or signal.Signals(signum).name

    _EARLY["received"] = None
    return {name: signal.signal(getattr(signal, name), caught) for name in EARLY_SIGNALS}


def release_early(previous: dict) -> None:
    """Put back what :func:`catch_early` replaced."""
    for name, handler in previous.items():
        signal.signal(getattr(signal, name), signal.SIG_DFL if handler is None else handler)
    _EARLY["received"] = None


class StopRequest:
    """The stop signals of ``trainer`` caught (a second one during the save changes nothing),
    and the deadline ``trainer.stop_at`` watched against the longest step and save seen.
    ``label``: the log prefix of the line saying a signal arrived (None: say nothing)."""

    def __init__(self, trainer, label: str | None):
        self.label = label
        self.signals = stop_signals(trainer.stop_signals)
        self.deadline = stop_deadline(trainer.stop_at)
        self.margin_s = float(trainer.stop_margin_s)
        early = _EARLY["received"]
        self.received: str | None = early if early in {s.name for s in self.signals} else None
        if self.received and label is not None:
            print(f"[{label}] {early} received during start-up: stopping at the first step "
                  "boundary", file=sys.stderr, flush=True)
        self.step_s = self.save_s = 0.0
        self._previous: dict = {}

    def install(self) -> "StopRequest":
        """Take over the stop signals (again: Ray's ``init`` sets its own SIGTERM handler)."""
        for sig in self.signals:
            previous = signal.signal(sig, self._caught)
            if previous is not self._caught:
                self._previous.setdefault(sig, previous)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            # None: a handler not set from Python, which cannot be put back; the default then.
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous = {}

    def _caught(self, signum, _frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
            if self.label is None:  # a worker: its driver says what it does about it
                return
            # os.write: safe inside a signal handler, unlike print.
            os.write(sys.stderr.fileno(), f"[{self.label}] {self.received} received: stopping "
                                          "at the next step boundary\n".encode())

    def observe(self, step_s: float = 0.0, save_s: float = 0.0) -> None:
        self.step_s, self.save_s = max(self.step_s, step_s), max(self.save_s, save_s)

    def reason(self, now: float | None = None) -> str | None:
        """Why to stop now, or None."""
        if self.received:
            return f"{self.received} received"
        if self.deadline is not None:
            left = self.deadline - (time.time() if now is None else now)
            needed = self.step_s + 2 * self.save_s + self.margin_s
            if left <= needed:
                return (f"trainer.stop_at in {max(left, 0):.0f} s, less than a step, two saves "
                        f"and the margin ({needed:.0f} s)")
        return None


def run_fingerprint(cfg) -> dict:
    """What decides how long a run is: a relaunch that changes none of it has nothing to do."""
    return {"max_steps": cfg.trainer.max_steps, "total_epochs": cfg.trainer.total_epochs,
            "train_batch_size": cfg.data.train_batch_size,
            "train_files": [str(f) for f in cfg.data.train_files]}


def _sizes(out: Path, evidence: list[str]) -> dict[str, int]:
    """Every file of ``evidence`` (paths under ``out``: files, or folders walked) with its
    size: what a finished run left, cheap to compare (stat only)."""
    found = {}
    for name in evidence:
        path = out / name
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        found.update({str(f.relative_to(out)): f.stat().st_size for f in files})
    return found


def finished(out: str | os.PathLike, cfg) -> int | None:
    """The step a run in ``out`` finished at: its marker names these settings and what the
    run left (final checkpoint, metrics) is still there as it was. Otherwise (more steps asked
    for, a checkpoint damaged or removed since) the marker goes and the run resumes."""
    out = Path(out)
    marker = out / FINISHED_FILE
    if not marker.is_file():
        return None
    try:
        saved = json.loads(marker.read_text())
        if saved["fingerprint"] == run_fingerprint(cfg) and \
                _sizes(out, saved["evidence"]) == saved["files"]:
            return int(saved["step"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # unreadable: as if absent
    marker.unlink(missing_ok=True)
    return None


def mark_finished(out: str | os.PathLike, cfg, step: int, evidence: list) -> None:
    """Written last, after the final checkpoint, validation and logs; ``evidence``: what the
    run left that a relaunch checks is unchanged (final checkpoint folders, metrics files)."""
    out = Path(out)
    names = [str(Path(e).relative_to(out)) if Path(e).is_absolute() else str(e) for e in evidence]
    names = [n for n in names if (out / n).exists()]
    marker = out / FINISHED_FILE
    partial = marker.with_suffix(".partial")
    partial.write_text(json.dumps({"step": step, "fingerprint": run_fingerprint(cfg),
                                   "evidence": names, "files": _sizes(out, names),
                                   "finished_at": time.time()}, indent=2))
    partial.replace(marker)


class MetricsFile:
    """``metrics.jsonl``: one JSON row per line, appended. A checkpoint records how many rows
    were written before it (:meth:`rows`); a resume from it keeps exactly those (:meth:`trim`),
    so rows written after it (the rest of a killed step, a final validation) are replaced."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def exists(self) -> bool:
        return self.path.is_file()

    def read(self) -> list[dict]:
        """Complete rows; a line half-written by a killed run is skipped."""
        if not self.path.is_file():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and "step" in row:
                out.append(row)
        return out

    def rows(self) -> int:
        return len(self.read())

    def append(self, row: dict) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps(row) + "\n")

    def trim(self, step: int, rows: int | None = None) -> list[dict]:
        """Keep the first ``rows`` rows (a checkpoint's count), or, for checkpoints written
        before the count existed, the rows up to ``step``; returns the kept rows."""
        kept = self.read()
        kept = kept[:rows] if rows is not None else [r for r in kept if r["step"] <= step]
        partial = self.path.with_suffix(".partial")
        partial.write_text("".join(json.dumps(r) + "\n" for r in kept))
        partial.replace(self.path)
        return kept
