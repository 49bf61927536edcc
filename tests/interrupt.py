"""Launching a run as a new user would, and interrupting it at chosen moments: SIGKILL of the
whole process tree (driver, Ray, workers, writer processes) or a stop signal to the driver.

A moment is a condition polled every 20 ms: a number of metrics rows, a save in progress (a
``*.partial`` checkpoint folder exists), or a delay after launch (start-up)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOLATILE = ("timing/", "throughput/", "busy/")  


def launch(args: list[str], log: Path) -> subprocess.Popen:
    """``python -m megatron_rlhf.cli *args`` in a session of its own, output to ``log``."""
    handle = log.open("a")
    return subprocess.Popen([sys.executable, "-m", "megatron_rlhf.cli", *args], cwd=ROOT,
                            stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)


def rows(out: Path) -> list[dict]:
    """Complete rows of ``metrics.jsonl``."""
    path = out / "metrics.jsonl"
    found = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return found


def steady(out: Path) -> list[dict]:
    """The rows without the values that measure time."""
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows(out)]


def saving(out: Path) -> bool:
    """A checkpoint is being written somewhere under ``out``."""
    return any(p.is_dir() for p in out.rglob("step_*.partial")) if out.is_dir() else False


def wait_until(proc: subprocess.Popen, condition, timeout: float = 300) -> bool:
    """Poll ``condition()`` until true (True) or the process ends (False)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    raise TimeoutError("the moment never came")


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL to every process of the run at once, as a node failure would: its session and
    every descendant (Ray's workers leave the session; left alive for a moment they could
    still commit the checkpoint being written)."""
    import psutil

    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for member in family:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    time.sleep(0.5)  # let the kernel reap Ray's daemons before the next launch


def finish(proc: subprocess.Popen, timeout: float = 600) -> int:
    return proc.wait(timeout=timeout)


def scalars(out: Path) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard's points per tag as TensorBoard shows them (purged steps hidden), without
    the tags that measure time."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"] if not tag.startswith(VOLATILE)}


def leftovers(out: Path) -> list[str]:
    """Folders of unfinished saves left under ``out``."""
    return sorted(str(p) for p in out.rglob("step_*") if p.name.endswith((".partial", ".stale")))
