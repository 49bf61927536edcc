"""User-function tools the tool tests name as ``tests.tool_fns:<function>`` (the worker processes
import them by that name, as a run's would)."""

import time

ARGS = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


def square(x: int) -> str:
    return str(x * x)


def nap(x: int) -> str:
    time.sleep(x)
    return f"slept {x}"


def explode(x: int) -> str:
    raise RuntimeError(f"boom {x}")


def lookup(x: int, row: dict) -> str:
    """Reads the sample's row, as a reward function does."""
    return f"{row['ground_truth']}:{x}"


def numbers(x: int):
    return {"x": x, "double": 2 * x}
