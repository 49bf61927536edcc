"""The bundled verifiable task: two-number addition, with a rule that checks any answer.

Seeded and self-contained, it supplies (a) PPO prompts with a ``ground_truth`` column, (b)
preference pairs whose ``chosen`` is correct and ``rejected`` plausibly wrong (one digit off, a
dropped carry, an off-by-one), and (c) SFT prompt/response pairs. The checker is the rule-based
reward for PPO and the oracle for evaluation.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

ANSWER = re.compile(r"answer is (-?\d+)")


@dataclass(frozen=True)
class AdditionTask:
    """Operands are drawn from ``[low, high]``."""

    low: int = 0
    high: int = 99

    def operand_pairs(self) -> list[tuple[int, int]]:
        return [(a, b) for a in range(self.low, self.high + 1) for b in range(self.low, self.high + 1)]

    @staticmethod
    def question(a: int, b: int) -> tuple[str, int]:
        return f"What is {a} + {b}?", a + b


def format_answer(value: int) -> str:
    return f"The answer is {value}."


def extract_answer(response: str) -> int | None:
    match = ANSWER.search(response)
    return int(match.group(1)) if match else None


def check_answer(response: str, ground_truth: str | int) -> float:
    """1.0 when ``response`` states the right number ("The answer is N"), else 0.0."""
    return float(extract_answer(response) == int(ground_truth))


def tool_trace(a: int, b: int, call: bool = True) -> list[dict]:
    """The SFT response for ``What is a + b?`` with a ``calculator`` tool: a hermes-format call
    with the sum's expression, the tool's answer and the final answer in the task's format
    (``call=False``: the final answer alone, as a policy that does not use the tool writes it)."""
    answer = [{"role": "assistant", "content": format_answer(a + b)}]
    if not call:
        return answer
    request = json.dumps({"name": "calculator", "arguments": {"expression": f"{a} + {b}"}})
    return [{"role": "assistant", "content": f"<tool_call>{request}</tool_call>"},
            {"role": "tool", "name": "calculator", "content": str(a + b)}, *answer]


def plausible_wrong(answer: int, rng: random.Random) -> int:
    """A near miss: one digit changed, a carry dropped or added, or off by one."""
    kind = rng.choice(("digit", "carry", "off_by_one"))
    if kind == "digit":
        digits = list(str(answer))
        position = rng.randrange(len(digits))
        choices = [d for d in "0123456789" if d != digits[position]]
        if position == 0 and len(digits) > 1:
            choices = [d for d in choices if d != "0"]
        digits[position] = rng.choice(choices)
        wrong = int("".join(digits))
    elif kind == "carry":
        wrong = answer + rng.choice((-10, 10))
    else:
        wrong = answer + rng.choice((-1, 1))
    return wrong if wrong >= 0 and wrong != answer else answer + 1


MALFORMED = ("The answer is .", "The answer is", "The answer is the answer.", "The answer is  .")


def rejected_answer(answer: int, rng: random.Random, malformed_rate: float = 0.2) -> str:
    """A rejected reply: usually a near miss, sometimes a reply that states no number at all.

    Real preference data rejects broken replies too; without them a reward model has never seen
    one and may score it highly, which PPO then finds and exploits.
    """
    if rng.random() < malformed_rate:
        return rng.choice(MALFORMED)
    return format_answer(plausible_wrong(answer, rng))


def split_operands(task: AdditionTask, val_fraction: float, seed: int):
    """Disjoint (train, validation) operand pairs: validation questions are never trained on."""
    pairs = task.operand_pairs()
    random.Random(seed).shuffle(pairs)
    cut = max(1, int(len(pairs) * val_fraction))
    return pairs[cut:], pairs[:cut]


def make_rows(operands: list[tuple[int, int]], count: int, seed: int) -> dict[str, list]:
    """``count`` rows drawn from ``operands``: prompt, ground_truth, chosen (correct), rejected."""
    rng = random.Random(seed)
    rows = {"prompt": [], "ground_truth": [], "chosen": [], "rejected": []}
    for _ in range(count):
        prompt, answer = AdditionTask.question(*rng.choice(operands))
        rows["prompt"].append(prompt)
        rows["ground_truth"].append(str(answer))
        rows["chosen"].append(format_answer(answer))
        rows["rejected"].append(rejected_answer(answer, rng))
    return rows


def parse_question(text: str, task: AdditionTask = AdditionTask()) -> tuple[int, int] | None:
    """A proposer's addition task: the first two numbers in ``text`` as operands, each within
    ``task``'s range; None when ``text`` holds no such pair."""
    numbers = re.findall(r"\d+", text)
    if len(numbers) < 2:
        return None
    a, b = int(numbers[0]), int(numbers[1])
    return (a, b) if task.low <= a <= task.high and task.low <= b <= task.high else None
