"""Worker processes for user-function tools, each call bounded by its own timeout.

The reward pool's design (``megatron_rlhf.rewards.pool``), for tools: fresh interpreters started
with ``python -c`` (safe under Ray's threaded driver, and they never re-import a user's
``__main__``) that resolve the tools' ``module:function`` specs themselves, so only strings,
arguments and text cross the pipe. A call still running past its deadline has its worker killed
and replaced; a worker that dies mid-call is replaced too. One bad call costs one restart.

Outcomes, in call order: ``("ok", text)``, ``("error", "Type: message")`` or ``("timeout", None)``.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections import deque
from multiprocessing.connection import Connection, wait

from megatron_rlhf.errors import UserError

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


_CHILD = """import sys
from multiprocessing.connection import Connection
conn = Connection({fd})
sys.path[:] = conn.recv()
from megatron_rlhf.agent_tools.fn_pool import _serve
_serve(conn, conn.recv())
"""


class _Worker:
    def __init__(self, specs: dict[str, str]):
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen([sys.executable, "-c", _CHILD.format(fd=theirs.fileno())],
                                        pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send(list(sys.path))  # the child imports our modules and the user's from it
        self.conn.send(specs)

    def wait_ready(self, deadline: float) -> None:
        if not self.conn.poll(max(0.0, deadline - time.monotonic())):
            self.stop()
            raise UserError(f"a tool worker did not start within {STARTUP_TIMEOUT_S:.0f} s")
        try:
            kind, detail = self.conn.recv()
        except (EOFError, OSError):
            kind, detail = "init_error", f"exited with code {self.process.wait()}"
        if kind != "ready":
            self.stop()
            raise UserError(f"a tool worker could not load the tools' functions: {detail}")

    def stop(self, grace_s: float = 0.0) -> None:
        if grace_s and self.process.poll() is None:
            try:
                self.conn.send(None)
                self.process.wait(grace_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.conn.close()


def _stop_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.stop(grace_s=2.0)
    workers.clear()


class FunctionPool:
    """``workers`` processes calling the user tools ``specs`` names (tool name -> spec)."""

    def __init__(self, specs: dict[str, str], workers: int):
        self.specs, self.restarts = dict(specs), 0
        self.workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _stop_all, self.workers)
        try:
            self.workers.extend(_Worker(self.specs) for _ in range(workers))
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            for worker in self.workers:
                worker.wait_ready(deadline)
        except BaseException:
            self.close()
            raise

    def _replace(self, worker: _Worker) -> _Worker:
        worker.stop()
        self.workers.remove(worker)
        fresh = _Worker(self.specs)
        fresh.wait_ready(time.monotonic() + STARTUP_TIMEOUT_S)
        self.workers.append(fresh)
        self.restarts += 1
        return fresh

    def map(self, calls: list[tuple[str, dict, dict, float]]) -> list[tuple[str, object]]:
        """Outcomes of ``(name, arguments, row, timeout_s)`` calls, in order; a call's clock
        starts when a worker takes it."""
        if not self.workers:
            raise RuntimeError("the tool pool is closed")
        outcomes: list = [None] * len(calls)
        pending, idle = deque(enumerate(calls)), list(self.workers)
        busy: dict[object, tuple[_Worker, int, float]] = {}  # conn -> (worker, call, deadline)
        while pending or busy:
            while pending and idle:
                worker, (index, (name, arguments, row, timeout_s)) = idle.pop(), pending.popleft()
                worker.conn.send((name, arguments, row))
                busy[worker.conn] = (worker, index, time.monotonic() + timeout_s)
            first_deadline = min(deadline for _, _, deadline in busy.values())
            for conn in wait(list(busy), timeout=max(0.0, first_deadline - time.monotonic())):
                worker, index, _ = busy.pop(conn)
                try:
                    outcomes[index] = conn.recv()
                except (EOFError, OSError):
                    outcomes[index] = ("error", f"the tool's worker died (exit code "
                                                f"{worker.process.poll()})")
                    worker = self._replace(worker)
                idle.append(worker)
            now = time.monotonic()
            for conn, (worker, index, deadline) in list(busy.items()):
                if now >= deadline and not conn.poll():
                    del busy[conn]
                    outcomes[index] = ("timeout", None)
                    idle.append(self._replace(worker))
        return outcomes

    def close(self) -> None:
        """Ask every worker to stop, kill the ones that do not within 2 s; idempotent."""
        self._finalizer()
