"""A process pool for reward functions with a per-call timeout.

Each worker is a fresh interpreter (safe under Ray's threaded driver, unlike ``fork``) that
resolves the reward specs itself (so nothing but strings and results cross the pipe), warms them
up, then scores one call at a time. The parent hands calls to idle workers and waits on their
pipes; a call still running ``timeout_s`` after it was handed over has its worker killed and
replaced, and a worker that dies mid-call (segfault, ``os._exit``) is replaced too. One bad call
therefore costs one worker restart, never the run.

Outcomes, in call order: ``("ok", (score, extras))``, ``("error", (exception type, message))``
or ``("timeout", None)``.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from megatron_rlhf.errors import UserError
from megatron_rlhf.rewards.registry import RewardOptions

Call = tuple  # (response, ground_truth, prompt, extra)
STARTUP_TIMEOUT_S = 300.0  # a worker's imports (reasoning-gym: seconds) on a loaded machine


def _serve(conn, specs: dict[str, str], options: RewardOptions) -> None:
    """Worker main loop: resolve, report ready, then ``(role, call)`` -> outcome until ``None``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    from megatron_rlhf.rewards.registry import resolve

    try:
        fns = {role: resolve(spec, role, options) for role, spec in specs.items()}
        for fn in fns.values():
            fn.prepare()
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
        role, call = message
        try:
            outcome = ("ok", fns[role].score(*call))
        except (Exception, SystemExit) as err:  # noqa: BLE001  any user error scores 0
            outcome = ("error", (type(err).__name__, str(err)[:500]))
        conn.send(outcome)


class _Worker:
    """One worker process. Started as ``python -c`` rather than ``multiprocessing``'s spawn,
    which re-imports the parent's ``__main__`` (a user's unguarded script, or ``<stdin>``)."""

    def __init__(self, serve_module: str, payload: tuple, what: str, loads: str, startup_s: float):
        self.what, self.loads, self.startup_s = what, loads, startup_s
        ours, theirs = socket.socketpair()
        code = _CHILD.format(fd=theirs.fileno(), module=serve_module)
        self.process = subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(),),
                                        stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send(list(sys.path))  # the child imports our modules and the user's from it
        self.conn.send(payload)

    def wait_ready(self, deadline: float) -> None:
        if not self.conn.poll(max(0.0, deadline - time.monotonic())):
            self.stop()
            raise UserError(f"a {self.what} worker did not start within {self.startup_s:.0f} s")
        try:
            kind, detail = self.conn.recv()
        except (EOFError, OSError):
            kind, detail = "init_error", f"exited with code {self.process.wait()}"
        if kind != "ready":
            self.stop()
            raise UserError(f"a {self.what} worker could not load {self.loads}: {detail}")

    def exit_code(self) -> int | None:
        try:
            return self.process.wait(1.0)
        except subprocess.TimeoutExpired:
            return None

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


_CHILD = """import sys
from multiprocessing.connection import Connection
conn = Connection({fd})
sys.path[:] = conn.recv()
from {module} import _serve
_serve(conn, *conn.recv())
"""


def _stop_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.stop(grace_s=2.0)
    workers.clear()


class WorkerPool:
    """``workers`` processes, each running ``serve_module._serve(conn, *payload)``: it resolves
    the user's functions, says ready, then answers one message at a time. Shared by the reward
    functions (below) and the tools' user functions (``agent_tools.fn_pool``)."""

    def __init__(self, serve_module: str, payload: tuple, workers: int, what: str, loads: str,
                 startup_s: float):
        self.worker_args = (serve_module, payload, what, loads, startup_s)
        self.what, self.restarts = what, 0
        self.workers: list[_Worker] = []
        # Also stops the workers if the owner forgets close() (daemon processes die with us anyway).
        self._finalizer = weakref.finalize(self, _stop_all, self.workers)
        try:
            self.workers.extend(_Worker(*self.worker_args) for _ in range(workers))
            deadline = time.monotonic() + startup_s
            for worker in self.workers:
                worker.wait_ready(deadline)
        except BaseException:
            self.close()
            raise

    def _replace(self, worker: _Worker) -> _Worker:
        worker.stop()
        self.workers.remove(worker)
        fresh = _Worker(*self.worker_args)
        fresh.wait_ready(time.monotonic() + fresh.startup_s)
        self.workers.append(fresh)
        self.restarts += 1
        return fresh

    def run(self, messages: list[tuple[object, float]],
            died: Callable[[_Worker], tuple]) -> list[tuple[str, object]]:
        """Outcomes of ``(message, timeout_s)`` pairs, in order; a message's clock starts when a
        worker takes it. ``died(worker)`` is the outcome of a message whose worker died."""
        if not self.workers:
            raise RuntimeError(f"the {self.what} pool is closed")
        outcomes: list = [None] * len(messages)
        pending, idle = deque(enumerate(messages)), list(self.workers)
        busy: dict[object, tuple[_Worker, int, float]] = {}  # conn -> (worker, call, deadline)
        while pending or busy:
            while pending and idle:
                worker, (index, (message, timeout_s)) = idle.pop(), pending.popleft()
                worker.conn.send(message)
                busy[worker.conn] = (worker, index, time.monotonic() + timeout_s)
            first_deadline = min(deadline for _, _, deadline in busy.values())
            for conn in wait(list(busy), timeout=max(0.0, first_deadline - time.monotonic())):
                worker, index, _ = busy.pop(conn)
                try:
                    outcomes[index] = conn.recv()
                except (EOFError, OSError):
                    outcomes[index] = died(worker)
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


class RewardPool(WorkerPool):
    """``workers`` processes scoring the functions ``specs`` names (role -> spec)."""

    def __init__(self, specs: dict[str, str], options: RewardOptions, workers: int, timeout_s: float):
        self.specs, self.options, self.timeout_s = dict(specs), options, timeout_s
        super().__init__("megatron_rlhf.rewards.pool", (self.specs, options), workers, "reward",
                         "the reward functions", STARTUP_TIMEOUT_S)

    def map(self, role: str, calls: list[Call]) -> list[tuple[str, object]]:
        """Score every call with ``role``'s function; outcomes in call order."""
        return self.run([((role, call), self.timeout_s) for call in calls], lambda worker: (
            "error", ("WorkerDied", f"the reward worker exited with code {worker.exit_code()}")))
