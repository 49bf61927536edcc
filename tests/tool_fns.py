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


def turn_reward(response: str, ground_truth: str, prompt: str, extra: dict) -> dict:
    """A reward per assistant turn of a tool trajectory (``extra["trajectory"]``): 0.25 for each
    tool answer a turn's calls got back without an error, and on the last turn 1 for a final
    answer (a turn without a call)."""
    turns: list[float] = []
    for message in extra["trajectory"]:
        if message["role"] == "assistant":
            turns.append(0.0)
        elif not message["content"].startswith("Error"):
            turns[-1] += 0.25
    final = 0.0 if "<tool_call>" in response else 1.0
    turns[-1] += final
    return {"score": final, "turn_scores": turns}


def slow_calculator(expression: str) -> str:
    """The calculator's answer to the tiny tool caller's one question, after a pause longer than
    a tiny model's update (a one-step-off run's weight sync then comes during the round)."""
    time.sleep(3.0)
    return "42" if expression.replace(" ", "") == "6*7" else "?"
