"""Runs the configured reward functions over a batch of calls and keeps each step's accounting.

Roles: ``fn`` (``reward.fn``, the training signal) and ``oracle`` (``reward.oracle_fn``, measured
only). Calls run in a :class:`RewardPool` (``workers > 0``: per-call timeout, isolation) or in
this process (``workers == 0``: no timeout is enforced). Either way a call that raises, returns
something that is not a score, or times out scores 0 and is counted; :meth:`drain` returns a
step's metrics (``reward/errors``, ``reward/timeouts``, the means of the functions' extras as
``reward/<name>``, the oracle's as ``reward/oracle/<name>``) and one log line per kind of
failure (function, and exception type or timeout), never one per call.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from megatron_rlhf.rewards.pool import Call, RewardPool
from megatron_rlhf.rewards.registry import (IN_PROCESS_SAFE, TURN_SCORES, RewardFunction,
                                            RewardOptions, resolve)

# Metric names the driver itself writes under reward/: a function's extra of the same name is
# logged as reward/fn_<name> instead of overwriting them.
RESERVED = frozenset({"errors", "timeouts", "score_mean", "score_median", "oracle_mean", "rm_mean"})
AUTO_MAX_WORKERS = 4
TRUTH_BUILTINS = frozenset({"addition", "math"})


def default_workers(specs: list[str]) -> int:
    """``reward.workers`` unset: in-process when every function is a cheap built-in that cannot
    hang (``addition``), else a pool of ``min(4, CPUs)`` workers."""
    if all(spec in IN_PROCESS_SAFE for spec in specs):
        return 0
    return max(1, min(AUTO_MAX_WORKERS, len(os.sched_getaffinity(0))))


@dataclass
class _Failures:
    count: int = 0
    first: str = ""


@dataclass
class _Tally:
    errors: int = 0
    timeouts: int = 0
    extras: dict[str, list[float]] = field(default_factory=dict)  # role/name -> [sum, count]
    failures: dict[tuple[str, str], _Failures] = field(default_factory=dict)  # (spec, kind)
    calls: dict[str, int] = field(default_factory=dict)  # spec -> calls this step


class RewardScorer:
    def __init__(self, fns: dict[str, RewardFunction], options: RewardOptions = RewardOptions(),
                 workers: int | None = None, timeout_s: float = 10.0):
        self.fns, self.options, self.timeout_s = fns, options, timeout_s
        self.workers = default_workers([f.spec for f in fns.values()]) if workers is None else workers
        self.pool: RewardPool | None = None
        self.tally = _Tally()

    @classmethod
    def from_specs(cls, fn: str | None, oracle: str | None, options: RewardOptions = RewardOptions(),
                   workers: int | None = None, timeout_s: float = 10.0) -> "RewardScorer":
        """Resolve ``reward.fn`` / ``reward.oracle_fn`` (config errors name the key)."""
        fns = {}
        if fn:
            fns["fn"] = resolve(fn, "reward.fn", options)
        if oracle:
            fns["oracle"] = resolve(oracle, "reward.oracle_fn", options)
        return cls(fns, options, workers, timeout_s)

    def needs_ground_truth(self) -> bool:
        """Whether prompts must carry a ground truth: the built-ins that compare against one
        (``addition``, ``math``, ``reasoning_gym:*``). ``format`` ignores it, and a user's
        function gets whatever the row has (``None`` when the column is absent)."""
        return any(f.spec in TRUTH_BUILTINS or f.spec.startswith("reasoning_gym:")
                   for f in self.fns.values())

    def check_ground_truth(self, truth: str) -> None:
        """Raise if a built-in cannot read ``truth`` (``addition`` wants an integer), so bad data
        stops the run at start-up, naming the row. Nothing else runs here: a user's function
        only ever runs where its timeout and error accounting apply."""
        if any(f.spec == "addition" for f in self.fns.values()):
            int(str(truth).strip())

    def start(self) -> "RewardScorer":
        """Start the pool (once per run; a no-op in-process or when already started)."""
        if self.workers > 0 and self.pool is None and self.fns:
            specs = {role: f.spec for role, f in self.fns.items()}
            self.pool = RewardPool(specs, self.options, self.workers, self.timeout_s)
        return self

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ scoring
    def score(self, role: str, calls: list[Call]) -> list[float]:
        """Scores of ``role``'s function for ``calls`` (each ``(response, ground_truth, prompt,
        extra)``); failed calls score 0 and are counted for :meth:`drain`."""
        return self.score_turns(role, calls)[0]

    def score_turns(self, role: str, calls: list[Call]) -> tuple[list[float], list[tuple | None]]:
        """:meth:`score`, and per call the ``turn_scores`` the function returned (None where it
        returned none, or failed)."""
        fn = self.fns[role]
        if self.pool is not None:
            outcomes = self.pool.map(role, list(calls))
        else:
            outcomes = [self._in_process(fn, call) for call in calls]
        t = self.tally
        t.calls[fn.spec] = t.calls.get(fn.spec, 0) + len(calls)
        scores, turns = [], []
        for kind, detail in outcomes:
            turns.append(detail[1].pop(TURN_SCORES, None) if kind == "ok" else None)
            if kind == "ok":
                score, extras = detail
                for name, value in extras.items():
                    total = t.extras.setdefault(self._metric(role, name), [0.0, 0])
                    total[0] += value
                    total[1] += 1
                scores.append(score)
                continue
            scores.append(0.0)
            if kind == "timeout":
                t.timeouts += 1
                key, first = (fn.spec, "timeout"), ""
            else:
                t.errors += 1
                key, first = (fn.spec, detail[0]), detail[1]
            failure = t.failures.setdefault(key, _Failures(first=first))
            failure.count += 1
        return scores, turns

    @staticmethod
    def _in_process(fn: RewardFunction, call: Call) -> tuple[str, object]:
        try:
            return "ok", fn.score(*call)
        except Exception as err:  # noqa: BLE001  any user error scores 0
            return "error", (type(err).__name__, str(err)[:500])

    @staticmethod
    def _metric(role: str, name: str) -> str:
        if role == "oracle":
            return f"reward/oracle/{name}"
        return f"reward/fn_{name}" if name in RESERVED else f"reward/{name}"

    def same_function(self) -> bool:
        """The oracle is the training function (its scores can be reused, not recomputed)."""
        return "fn" in self.fns and "oracle" in self.fns and self.fns["fn"].spec == self.fns["oracle"].spec

    # ------------------------------------------------------------------ accounting
    def drain(self) -> tuple[dict[str, float], list[str]]:
        """Metrics and log lines for the calls since the last drain; resets the counters."""
        t, self.tally = self.tally, _Tally()
        metrics = {"reward/errors": float(t.errors), "reward/timeouts": float(t.timeouts)}
        metrics |= {name: total / count for name, (total, count) in t.extras.items()}
        lines = []
        for (spec, kind), failure in t.failures.items():
            of = f"{failure.count} of {t.calls.get(spec, 0)} call(s)"
            if kind == "timeout":
                lines.append(f"reward {spec!r} timed out (reward.timeout_s={self.timeout_s:g}) on {of}; "
                             "scored 0")
            else:
                lines.append(f"reward {spec!r} raised {kind} on {of}; scored 0 (first: {failure.first})")
        return metrics, lines
