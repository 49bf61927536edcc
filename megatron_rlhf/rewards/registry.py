"""Rule-based (verifiable) rewards, resolved by name and checked at start-up.

``reward.fn`` (and ``reward.oracle_fn``) name one of:

- a built-in: ``addition`` (the bundled task's checker), ``math`` (``\\boxed{}`` or last number,
  equivalence by math-verify), ``format`` (``reward.format_pattern`` matches the whole response);
- ``reasoning_gym:<task>``: that reasoning-gym task's own ``score_answer``;
- ``package.module:function``: any importable function.

The call: ``fn(response, ground_truth, prompt, extra)``

- ``response``: the decoded reply (special tokens skipped; in multi-turn rollouts one turn);
- ``ground_truth``: the row's ``data.ground_truth_key`` value as a string;
- ``prompt``: the row's prompt text (for chat-message prompts, the last user message's content);
- ``extra``: a dict of the row's other Parquet columns (every column but the prompt and the
  ground truth), by name, as Python values; ``{}`` when there are none. Datasets written by
  ``tools/make_task_data.py --source reasoning-gym`` carry ``task`` and ``metadata`` (a JSON
  string, the generator's entry metadata). Tool trajectories (``rollout.tools``) add
  ``trajectory``: the conversation after the prompt, ``[{"role": "assistant" | "tool",
  "content": ...}, ...]`` (``response`` is its last assistant turn).

Functions of two arguments, ``fn(response, ground_truth)`` (the older signature, e.g.
``addition``), keep working: the arity is read once, here. A function returns a float, or a dict
with a ``score`` and named numeric extras, which the PPO driver logs as ``reward/<name>`` (means
over a step's calls). For a tool trajectory the dict may also hold ``turn_scores``, one number
per assistant turn: each is then that turn's reward, on its last token (their sum is the
sequence's score; ``score`` stays the function's verdict on the whole trajectory, which
``val/oracle_acc`` reuses). A name that resolves to nothing is a config error naming the key.
"""

from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable

from megatron_rlhf.data.tasks import check_answer
from megatron_rlhf.errors import UserError

DEFAULT_FORMAT_PATTERN = r"<think>.*?</think>\s*<answer>.*?</answer>"


@dataclass(frozen=True)
class RewardOptions:
    """Settings the configurable built-ins read (``reward.format_pattern``)."""

    format_pattern: str = DEFAULT_FORMAT_PATTERN


def _format(options: RewardOptions, key: str):
    from megatron_rlhf.rewards.verifiable import FormatReward

    return FormatReward(options.format_pattern)


def _math(options: RewardOptions, key: str):
    from megatron_rlhf.rewards.verifiable import math_reward, require_math_verify

    require_math_verify(key)  # never a quiet fallback to string equality
    return math_reward


# name -> factory(options, the config key naming it) -> function; the factories keep optional
# imports lazy and name the key when they refuse.
_REGISTRY: dict[str, Callable[[RewardOptions, str], Callable]] = {
    "addition": lambda options, key: check_answer,
    "math": _math,
    "format": _format,
}
# Built-ins that are cheap, bounded and never hang: run in-process unless told otherwise.
IN_PROCESS_SAFE = frozenset({"addition"})


def register(name: str, fn: Callable) -> None:
    """Make ``fn`` available as ``reward.fn=name`` (in this process; a pool worker resolves
    names itself, so prefer ``package.module:function`` for functions outside this package)."""
    _REGISTRY[name] = lambda options, key: fn


def known_names() -> list[str]:
    return sorted(_REGISTRY)


@dataclass(frozen=True)
class RewardFunction:
    """A resolved reward: ``spec`` as configured, the function, and whether it takes the
    context arguments (``prompt``, ``extra``) or only ``(response, ground_truth)``."""

    spec: str
    fn: Callable
    takes_context: bool

    def __call__(self, response: str, ground_truth: str, prompt: str = "", extra: dict | None = None):
        """The function's own return value (a float or a dict)."""
        if self.takes_context:
            return self.fn(response, ground_truth, prompt, {} if extra is None else extra)
        return self.fn(response, ground_truth)

    def score(self, response: str, ground_truth: str, prompt: str = "",
              extra: dict | None = None) -> tuple[float, dict[str, float]]:
        """``(score, extras)``; raises on a return value that is not a finite number or a dict
        with a finite ``score`` and numeric extras."""
        return as_score(self(response, ground_truth, prompt, extra))

    def prepare(self) -> None:
        """Load what the first call would (a pool worker does this before taking calls)."""
        hook = getattr(self.fn, "prepare", None)
        if callable(hook):
            hook()


def as_score(value: Any) -> tuple[float, dict[str, Any]]:
    """A reward function's return value as ``(score, extras)``; ``extras["turn_scores"]``, when
    returned, is a tuple of finite floats, every other extra a float."""
    extras: dict[str, Any] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise TypeError(f"returned a dict without 'score' (keys: {', '.join(map(str, value))})")
        for name, extra in value.items():
            if name == TURN_SCORES:
                extras[name] = _turn_scores(extra)
            elif name != "score":
                extras[str(name)] = _number(extra, f"extra {name!r}")
        value = value["score"]
    score = _number(value, "score")
    if not math.isfinite(score):
        raise ValueError(f"returned a score of {score}")
    return score, extras


TURN_SCORES = "turn_scores"


def _turn_scores(value: Any) -> tuple[float, ...]:
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise TypeError(f"turn_scores is {type(value).__name__}, not a list of numbers")
    out = tuple(_number(v, "a turn score") for v in value)
    if not out or not all(math.isfinite(v) for v in out):
        raise ValueError(f"returned turn_scores {list(out)}: one finite number per assistant turn")
    return out


def _number(value: Any, what: str) -> float:
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"{what} is {type(value).__name__}, not a number")
    try:
        return float(value)  # bool, int, numpy and torch scalars
    except (TypeError, ValueError):
        raise TypeError(f"{what} is {type(value).__name__}, not a number") from None


def resolve(spec: str, key: str = "reward.fn", options: RewardOptions = RewardOptions()) -> RewardFunction:
    """The function ``spec`` names; :class:`UserError` naming ``key`` when there is none."""
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(f"config: {key}={spec!r} must name a reward function")
    if spec in _REGISTRY:
        fn = _REGISTRY[spec](options, key)
    elif spec.startswith("reasoning_gym:"):
        from megatron_rlhf.rewards.verifiable import ReasoningGymReward

        fn = ReasoningGymReward.checked(spec.split(":", 1)[1], key)
    elif ":" in spec:
        fn = import_function(spec, key)
    else:
        raise UserError(f"config: {key}={spec!r} is not a built-in reward ({', '.join(known_names())}), "
                        "'reasoning_gym:<task>' or 'package.module:function'")
    return RewardFunction(spec, fn, _takes_context(fn, spec, key))


def get_reward_fn(name: str) -> RewardFunction:
    """``resolve(name)`` for ``reward.fn`` with default options (callable with 2 or 4 arguments)."""
    return resolve(name)


def import_function(spec: str, key: str) -> Callable:
    """The callable ``package.module:function`` names; :class:`UserError` naming ``key`` when it
    does not import (also used by the tool registry, ``rollout.tools[].fn``)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UserError(f"config: {key}={spec!r} must read 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UserError(f"config: {key}={spec!r}: cannot import module {module_name!r} "
                        f"({type(err).__name__}: {err})") from None
    except Exception as err:  # the module's own top level failed
        raise UserError(f"config: {key}={spec!r}: importing {module_name!r} raised "
                        f"{type(err).__name__}: {err}") from None
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise UserError(f"config: {key}={spec!r}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise UserError(f"config: {key}={spec!r} is a {type(fn).__name__}, not a function")
    return fn


def _takes_context(fn: Callable, spec: str, key: str) -> bool:
    """True for ``(response, ground_truth, prompt, extra)``, False for ``(response,
    ground_truth)``; anything else is a config error."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # some C functions have no signature: the old form
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    required_kw = [p for p in params if p.kind == p.KEYWORD_ONLY and p.default is p.empty]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    if not required_kw and len(required) <= 4 and (len(positional) >= 4 or varargs):
        return True
    if not required_kw and len(required) <= 2 <= len(positional):
        return False
    raise UserError(f"config: {key}={spec!r} takes ({', '.join(p.name for p in params)}); a reward "
                    "function takes (response, ground_truth) or (response, ground_truth, prompt, extra)")
