"""Running a round of tool calls: :class:`ToolSession` and the metrics of its results.

What runs where: ``python`` calls each in a sandboxed process (``sandbox.py``), at most
``workers`` at once from a thread pool; ``calculator`` in this process (bounded by construction);
user functions in ``workers`` worker processes of their own (fresh interpreters, as the reward
pool's), each call bounded by its tool's ``timeout_s`` (a worker past it is killed and replaced).
All of a round's calls run concurrently. Nothing raises out of :meth:`ToolSession.run_round`: a
failure, a timeout, malformed or invalid arguments all come back as a :class:`ToolResult` whose
text tells the policy what went wrong, counted in :func:`tool_metrics`.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from megatron_rlhf.agent_tools.calculator import CalculatorError, calculate
from megatron_rlhf.agent_tools.fn_pool import FunctionPool
from megatron_rlhf.agent_tools.parsers import Call, ParseError
from megatron_rlhf.agent_tools.sandbox import SandboxLimits, check_isolation, run_python
from megatron_rlhf.agent_tools.spec import ToolSpec

BYTES_PER_TOKEN = 8  # output read per token of budget before the exact cut by the tokenizer


@dataclass(frozen=True)
class ToolResult:
    """One call's answer: ``text`` goes back to the policy as the tool message."""

    name: str
    text: str
    error: bool = False
    timeout: bool = False
    truncated: bool = False


class ToolSession:
    """The tools of a run, ready to answer calls: built once at start-up (which probes the
    sandbox and starts the user-function workers, so a problem stops the run there)."""

    def __init__(self, tools: list[ToolSpec], tokenizer=None, workers: int = 4,
                 sandbox: str = "require"):
        self.tools = {tool.name: tool for tool in tools}
        self.tokenizer, self.workers = tokenizer, workers
        self.isolation = (check_isolation(sandbox) if any(t.fn == "python" for t in tools)
                          else None)
        user = {t.name: t.fn for t in tools if not t.builtin}
        self.pool = FunctionPool(user, workers) if user else None
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tool")
        # Rounds of different threads (agents generating ahead) take turns: the worker pool
        # answers one map at a time.
        self._lock = threading.Lock()

    def run_round(self, calls: list[Call | ParseError], rows: list[dict] | None = None) -> list[ToolResult]:
        """The results of ``calls`` (the parsed calls of a round, any samples), in order;
        ``rows[i]``: the row of the sample ``calls[i]`` came from (user functions taking ``row``
        get it)."""
        with self._lock:
            return self._run_round(calls, rows)

    def _run_round(self, calls: list[Call | ParseError], rows: list[dict] | None) -> list[ToolResult]:
        rows = rows if rows is not None else [{}] * len(calls)
        results: list[ToolResult | None] = [None] * len(calls)
        sandboxed, user = {}, []
        for i, call in enumerate(calls):
            if isinstance(call, ParseError):
                results[i] = ToolResult(self._known(call.name), f"Error: {call.message}", error=True)
            elif self.tools[call.name].fn == "python":
                sandboxed[i] = self._threads.submit(self._python, call)
            elif self.tools[call.name].fn == "calculator":
                results[i] = self._calculator(call)
            else:
                user.append(i)
        if user:
            items = [(calls[i].name, calls[i].arguments, rows[i], self.tools[calls[i].name].timeout_s)
                     for i in user]
            for i, outcome in zip(user, self.pool.map(items)):
                results[i] = self._user_result(calls[i].name, outcome)
        for i, future in sandboxed.items():
            results[i] = future.result()
        return [self._cut(result) for result in results]

    def _known(self, name: str | None) -> str:
        """A metric-safe name: the tool's, or ``invalid`` for names the policy made up."""
        return name if name in self.tools else "invalid"

    def _python(self, call: Call) -> ToolResult:
        tool = self.tools[call.name]
        limits = SandboxLimits(wall_s=tool.timeout_s, cpu_s=max(1, math.ceil(tool.timeout_s)),
                               output_bytes=tool.max_response_tokens * BYTES_PER_TOKEN)
        run = run_python(call.arguments["code"], limits, self.isolation)
        if run.timed_out:
            return ToolResult(call.name, f"{run.output}Error: timed out after {tool.timeout_s:g} s",
                              error=True, timeout=True, truncated=run.truncated)
        if run.signal == 24:  # SIGXCPU
            return ToolResult(call.name, f"{run.output}Error: CPU time limit "
                              f"({limits.cpu_s} s) exceeded", error=True, timeout=True)
        failed = bool(run.exit_code) and not run.truncated
        text = run.output if run.output or not failed else f"Error: exit code {run.exit_code}"
        return ToolResult(call.name, text, error=failed, truncated=run.truncated)

    def _calculator(self, call: Call) -> ToolResult:
        try:
            return ToolResult(call.name, calculate(call.arguments["expression"]))
        except CalculatorError as err:
            return ToolResult(call.name, f"Error: {err}", error=True)

    def _user_result(self, name: str, outcome: tuple) -> ToolResult:
        kind, value = outcome
        if kind == "timeout":
            return ToolResult(name, f"Error: timed out after {self.tools[name].timeout_s:g} s",
                              error=True, timeout=True)
        if kind == "error":
            return ToolResult(name, f"Error: {value}", error=True)
        return ToolResult(name, value)

    def _cut(self, result: ToolResult) -> ToolResult:
        """At most the tool's ``max_response_tokens`` tokens of the policy's tokenizer (without
        one, ``BYTES_PER_TOKEN`` characters a token)."""
        budget = self.tools[result.name].max_response_tokens if result.name in self.tools else 256
        text = result.text[: budget * BYTES_PER_TOKEN]  # never tokenise megabytes a function returned
        if self.tokenizer is not None:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            text = self.tokenizer.decode(ids[:budget]) if len(ids) > budget else text
        if text == result.text:
            return result
        return ToolResult(result.name, text, result.error, result.timeout, truncated=True)

    def close(self) -> None:
        self._threads.shutdown(wait=True)
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> ToolSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tool_metrics(results: list[ToolResult]) -> dict[str, float]:
    """``tools/{calls,errors,timeouts,truncated}`` and the same per tool name
    (``tools/<name>/calls``, ...), summed over ``results``."""
    totals: Counter = Counter()
    for result in results:
        flags = {"calls": True, "errors": result.error, "timeouts": result.timeout,
                 "truncated": result.truncated}
        for what, flag in flags.items():
            totals[f"tools/{what}"] += int(flag)
            totals[f"tools/{result.name}/{what}"] += int(flag)
    return {key: float(value) for key, value in sorted(totals.items())}
