"""User-function tools the tool tests name as ``tests.tool_fns:<function>`` (the worker processes
import them by that name, as a run's would)."""

import time
from pathlib import Path

ARGS = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


def square(x: int) -> str:
    return str(x * x)


def nap(x: int) -> str:
    time.sleep(x)
    return f"slept {x}"


def meet(x: int, row: dict) -> str:
    """Calls 0 and 1 each leave a mark in ``row["meeting"]`` and wait for the other's: "met" only
    when both run at the same time (one after the other, the first waits out its 5 s alone)."""
    folder = Path(row["meeting"])
    (folder / str(x)).touch()
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if (folder / str(1 - x)).exists():
            return "met"
        time.sleep(0.01)
    return "alone"


def explode(x: int) -> str:
    raise RuntimeError(f"boom {x}")


def lookup(x: int, row: dict) -> str:
    """Reads the sample's row, as a reward function does."""
    return f"{row['ground_truth']}:{x}"


def numbers(x: int):
    return {"x": x, "double": 2 * x}
