"""Built-in verifiable rewards: ``math``, ``format`` and ``reasoning_gym:<task>``.

``math``: the answer is the content of the response's last complete ``\\boxed{...}``, or else its
last number (``-12``, ``3.5``, ``1,000``, ``3/4``). It equals the ground truth when

1. both read as exact numbers (fractions, decimals and thousands separators allowed) and the
   numbers are equal, or the two strings are equal once spaces, ``$`` and a trailing ``.`` are
   removed (a fast path); or
2. math-verify finds them equivalent (LaTeX and symbolic forms: ``\\frac{1}{2}`` = ``0.5``,
   ``x+1`` = ``1+x``). math-verify is required: without it ``reward.fn=math`` is refused at
   start-up (the ``[tasks]`` extra installs it), never quietly weakened to the fast path alone.

It returns ``{"score": 1.0 or 0.0, "answer_found": 1.0 or 0.0}``, so ``reward/answer_found``
shows how often replies state an answer at all.

``format``: 1.0 when the whole (stripped) response matches ``reward.format_pattern`` (a Python
regex, ``.`` matching newlines too), else 0.0.

``reasoning_gym:<task>``: the task's own ``score_answer(answer, entry)``, where the answer is the
content of the last ``<answer>...</answer>`` in the response (reasoning-gym's convention) or else
the whole stripped response, and the entry is ``{"question": prompt, "answer": ground_truth,
"metadata": extra["metadata"]}`` (a JSON string column is decoded; ``{}`` when absent). Its
``answer_tagged`` extra (``reward/answer_tagged``) is the share of well-formed answers.
"""

from __future__ import annotations

import json
import re
import threading
from fractions import Fraction

from megatron_rlhf.errors import UserError

_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:/\d+)?")
_BOXED = "\\boxed{"


def last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` (nested braces allowed), or None."""
    start = text.rfind(_BOXED)
    while start != -1:
        depth, i = 1, start + len(_BOXED)
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start + len(_BOXED):i - 1].strip()
        start = text.rfind(_BOXED, 0, start)  # cut off (truncated reply): try the one before
    return None


def extract_math_answer(response: str) -> str | None:
    """The last ``\\boxed{}``'s content, else the last number, else None."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(response)
    return numbers[-1] if numbers else None


def _normalise(text: str) -> str:
    return re.sub(r"\s+", "", str(text)).strip("$").rstrip(".")


def _exact_number(text: str) -> Fraction | None:
    text = _normalise(text).replace(",", "")
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def simple_equal(answer: str, truth: str) -> bool:
    """The fallback: equal exact numbers, or equal normalised strings."""
    a, t = _exact_number(answer), _exact_number(truth)
    if a is not None and t is not None:
        return a == t
    return _normalise(answer) == _normalise(truth)


def _math_verify():
    """``(parse, verify)`` from math-verify, or None when it is not installed."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    return parse, verify


def require_math_verify(key: str = "reward.fn") -> None:
    """:class:`UserError` naming ``key`` when math-verify is not installed."""
    if _math_verify() is None:
        raise UserError(f"config: {key}=math needs the math-verify package (pip install "
                        "'megatron_rlhf[tasks]', or pip install math-verify)")


def math_equal(answer: str, truth: str) -> bool:
    if simple_equal(answer, truth):
        return True
    mv = _math_verify()
    if mv is None:
        require_math_verify()
    parse, verify = mv
    # math-verify times itself out with SIGALRM, which only the main thread may use.
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"\\boxed{{{truth}}}", parsing_timeout=limit)
    given = parse(f"\\boxed{{{answer}}}", parsing_timeout=limit)
    return bool(gold and given and verify(gold, given, timeout_seconds=limit))


def math_reward(response: str, ground_truth: str) -> dict[str, float]:
    answer = extract_math_answer(response)
    if answer is None:
        return {"score": 0.0, "answer_found": 0.0}
    return {"score": float(math_equal(answer, str(ground_truth))), "answer_found": 1.0}


def _warm_math() -> None:
    """math-verify's first parse imports sympy and its LaTeX grammar (seconds): do it before
    the first timed call."""
    if _math_verify() is not None:
        math_equal("\\frac{1}{2}", "x")


math_reward.prepare = _warm_math  # RewardFunction.prepare() calls it in each pool worker


class FormatReward:
    """1.0 when the whole stripped response matches ``pattern``."""

    def __init__(self, pattern: str):
        self.pattern = pattern
        self.regex = re.compile(pattern, re.DOTALL)

    def __call__(self, response: str, ground_truth: str) -> float:
        return 1.0 if self.regex.fullmatch(response.strip()) else 0.0


_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)


class ReasoningGymReward:
    """A reasoning-gym task's own scorer (see the module docstring)."""

    def __init__(self, task: str):
        self.task = task
        self._score_answer = None

    @classmethod
    def checked(cls, task: str, key: str) -> "ReasoningGymReward":
        """The reward for ``task``; :class:`UserError` naming ``key`` when reasoning-gym is
        missing or has no such task."""
        try:
            from reasoning_gym.factory import DATASETS
        except ImportError:
            raise UserError(f"config: {key}=reasoning_gym:{task} needs the reasoning-gym package "
                            "(pip install reasoning-gym, or the project's [tasks] extra)") from None
        if task not in DATASETS:
            import difflib

            close = difflib.get_close_matches(task, list(DATASETS), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else f" ({len(DATASETS)} tasks known)"
            raise UserError(f"config: {key}=reasoning_gym:{task}: reasoning-gym has no task {task!r}{hint}")
        return cls(task)

    def prepare(self) -> None:
        if self._score_answer is None:
            import reasoning_gym

            self._score_answer = reasoning_gym.get_score_answer_fn(self.task)

    @staticmethod
    def answer(response: str) -> str:
        tagged = _ANSWER_TAG.findall(response)
        return tagged[-1].strip() if tagged else response.strip()

    def __call__(self, response: str, ground_truth: str, prompt: str, extra: dict) -> dict:
        """``{"score": the task's score, "answer_tagged": 1.0 when the response states its
        answer in <answer> tags}``: the extra shows how often answers are malformed."""
        self.prepare()
        metadata = extra.get("metadata") or {}
        if isinstance(metadata, str):
            metadata = json.loads(metadata)
        entry = {"question": prompt, "answer": str(ground_truth), "metadata": metadata}
        tagged = float(bool(_ANSWER_TAG.search(response)))
        return {"score": float(self._score_answer(self.answer(response), entry)),
                "answer_tagged": tagged}

    def __getstate__(self):  # the scorer is rebuilt where it is unpickled
        return {"task": self.task, "_score_answer": None}
