"""Worker processes for user-function tools, each call bounded by its own timeout.

The reward pool's machinery (``megatron_rlhf.rewards.pool.WorkerPool``), for tools: fresh
interpreters started with ``python -c`` (safe under Ray's threaded driver, and they never re-import a user's
``__main__``) that resolve the tools' ``module:function`` specs themselves, so only strings,
arguments and text cross the pipe. A call still running past its deadline has its worker killed
and replaced; a worker that dies mid-call is replaced too. One bad call costs one restart.

Outcomes, in call order: ``("ok", text)``, ``("error", "Type: message")`` or ``("timeout", None)``.
"""

from __future__ import annotations

import json
import signal

from megatron_rlhf.rewards.pool import WorkerPool

STARTUP_TIMEOUT_S = 120.0


def _serve(conn, specs: dict[str, str]) -> None:
    """Worker loop: resolve, report ready, then ``(name, arguments, row)`` -> outcome."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    from megatron_rlhf.agent_tools.spec import resolve_function

    try:
        fns = {name: resolve_function(spec, f"rollout.tools ({name}).fn") for name, spec in specs.items()}
    except BaseException as err:  # noqa: BLE001  reported to the parent, which stops the run
        conn.send(("init_error", f"{type(err).__name__}: {err}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        name, arguments, row = message
        fn, takes_row = fns[name]
        try:
            value = fn(**arguments, row=row) if takes_row else fn(**arguments)
            # text crosses the pipe, whatever came back (a number, a dict: as JSON)
            outcome = ("ok", value if isinstance(value, str) else json.dumps(value, default=str))
        except (Exception, SystemExit) as err:  # noqa: BLE001  any failure is text for the policy
            outcome = ("error", f"{type(err).__name__}: {str(err)[:500]}")
        conn.send(outcome)


class FunctionPool(WorkerPool):
    """``workers`` processes calling the user tools ``specs`` names (tool name -> spec)."""

    def __init__(self, specs: dict[str, str], workers: int):
        self.specs = dict(specs)
        super().__init__("megatron_rlhf.agent_tools.fn_pool", (self.specs,), workers, "tool",
                         "the tools' functions", STARTUP_TIMEOUT_S)

    def map(self, calls: list[tuple[str, dict, dict, float]]) -> list[tuple[str, object]]:
        """Outcomes of ``(name, arguments, row, timeout_s)`` calls, in order; a call's clock
        starts when a worker takes it."""
        return self.run([((name, arguments, row), timeout_s)
                         for name, arguments, row, timeout_s in calls],
                        lambda worker: ("error", f"the tool's worker died (exit code "
                                                 f"{worker.process.poll()})"))
