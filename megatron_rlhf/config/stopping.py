"""``trainer.stop_signals`` and ``trainer.stop_at``: parsed and checked once, at start-up."""

from __future__ import annotations

import datetime
import os
import re
import signal

from megatron_rlhf.errors import UserError

JOB_START_ENV = "MEGATRON_RLHF_JOB_START"
"""Unix time the command was launched, set by the CLI and inherited by the ranks it starts, so
that a duration in ``trainer.stop_at`` counts from the job's start, not from a rank's set-up."""

_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?$")
# Signals a clean stop may not take over: the kill signals cannot be caught, and SIGINT stays
# the interactive interrupt.
_REFUSED = {"SIGKILL", "SIGSTOP", "SIGINT"}


def stop_signals(names) -> list[signal.Signals]:
    """``trainer.stop_signals`` as signals; a name that is not one is a :class:`UserError`."""
    out = []
    for name in list(names or []):
        text = str(name).upper()
        text = text if text.startswith("SIG") else f"SIG{text}"
        sig = getattr(signal.Signals, text, None) if text not in _REFUSED else None
        if sig is None:
            raise UserError(f"config: trainer.stop_signals has {name!r}: give signal names such "
                            "as SIGUSR1, SIGUSR2, SIGTERM (not SIGKILL, SIGSTOP or SIGINT)")
        out.append(sig)
    return list(dict.fromkeys(out))


def _duration_s(text: str) -> float | None:
    match = _DURATION.match(text)
    if not match or not any(match.groups()):
        return None
    hours, minutes, seconds = (float(g or 0) for g in match.groups())
    return hours * 3600 + minutes * 60 + seconds


def job_start(env=None) -> float:
    """When the job started: Slurm's start time, else the launch of the command."""
    env = os.environ if env is None else env
    for key in ("SLURM_JOB_START_TIME", JOB_START_ENV):
        try:
            return float(env[key])
        except (KeyError, ValueError):
            continue
    import psutil

    return psutil.Process().create_time()


def stop_deadline(value, env=None) -> float | None:
    """``trainer.stop_at`` as a Unix time (``None``: no deadline)."""
    env = os.environ if env is None else env
    text = str(value if value is not None else "none").strip()
    if text.lower() in ("none", "", "off"):
        return None
    if text.lower() == "auto":
        end = env.get("SLURM_JOB_END_TIME")
        try:
            return float(end) if end and float(end) > 0 else None
        except ValueError:
            raise UserError(f"SLURM_JOB_END_TIME={end!r} is not a Unix time; set "
                            "trainer.stop_at explicitly") from None
    seconds = _duration_s(text.lower())
    if seconds is not None:
        return job_start(env) + seconds
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise UserError(f"config: trainer.stop_at={value!r} must be auto, none, a Unix time, an "
                        "ISO date-time (2026-12-03T06:00) or a duration from the job's start "
                        "(90m, 4h, 1h30m, 3600s)") from None
    return when.timestamp()  # naive: local time, as a user writes it


def check_stop_settings(trainer) -> None:
    """The ``trainer.stop_*`` settings, checked once at start-up."""
    stop_signals(trainer.stop_signals)
    stop_deadline(trainer.stop_at)
    if not trainer.stop_margin_s >= 0:
        raise UserError(f"config: trainer.stop_margin_s={trainer.stop_margin_s} must be >= 0")
