"""The ``python`` tool's sandbox: code a policy wrote, run where it can read nothing of ours,
reach nothing, and use bounded resources.

Isolation (Debian's ``bubblewrap``, verified in docs/tools.md):

- files: only the Python runtime (read-only binds of ``/usr`` and the ``/lib``, ``/bin``
  links), a fresh ``/proc`` and ``/dev``, the code read-only at ``/sandbox/main.py`` and an empty
  size-capped tmpfs at ``/tmp`` (its working directory, its only writable place, gone after);
- ``--unshare-all``: its own network (no interface up: no traffic leaves), PID, IPC, UTS, cgroup
  and user namespaces; ``--die-with-parent``; a cleared environment;
- as root we drop to ``nobody`` first: the kernel exempts root from the process-count limit.

Limits, set by the launcher inside before the code runs (hard = soft, so the code cannot raise
them): CPU seconds, address space, file size, processes; plus a wall-clock timeout that kills
the whole process group, and output read incrementally up to a byte cap (the process is killed
past it, so megabytes of output never reach our memory).

Without bwrap (or when it cannot create namespaces) ``rollout.sandbox=best_effort`` keeps the
limits, the cleared environment, the drop to ``nobody`` and a fresh working directory, but the
host's files are readable and the network is reachable: :func:`isolation` says which.
"""

from __future__ import annotations

import functools
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_rlhf.errors import UserError

NOBODY = 65534
INSIDE_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}  # -I ignores PYTHON*


@dataclass(frozen=True)
class SandboxLimits:
    """Per run. ``cpu_s`` counts CPU time (all threads); ``wall_s`` real time."""

    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024  # address space of each process
    file_size_mb: int = 16  # largest file it may write
    processes: int = 32  # processes and threads at once, its own user namespace's count
    tmp_mb: int = 64  # the tmpfs at /tmp (bwrap only)
    output_bytes: int = 64 * 1024  # read at most this much of stdout + stderr


@dataclass(frozen=True)
class Isolation:
    """What the sandbox can give here: ``bwrap`` (its path) or None and ``missing`` (why, one
    line)."""

    bwrap: str | None
    missing: str = ""
    python: str = "/usr/bin/python3"


@dataclass(frozen=True)
class SandboxRun:
    """``output``: stdout and stderr interleaved, decoded (cut at ``output_bytes``);
    ``signal``: the signal that ended the code (24 = SIGXCPU: the CPU limit), else 0; ``exit_code`` None when it timed out."""

    output: str
    exit_code: int | None
    signal: int
    timed_out: bool
    truncated: bool
    seconds: float


def _base_python() -> str:
    """An interpreter visible inside the sandbox: Debian's under /usr, else the one running us
    without its virtual environment (whose prefix is then bound too)."""
    if Path("/usr/bin/python3").exists():
        return "/usr/bin/python3"
    return str(Path(sys.base_prefix) / "bin" / "python3")


@functools.lru_cache(maxsize=None)
def isolation() -> Isolation:
    """Probe once: does ``bwrap`` exist and create its namespaces here (as the user the code
    will run as)?"""
    python = _base_python()
    path = shutil.which("bwrap")
    if path is None:
        return Isolation(None, "bwrap (bubblewrap) is not installed: no filesystem or network "
                               "isolation", python)
    probe = _bwrap_argv(path, python, None, SandboxLimits()) + ["-c", "print('ok')"]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=30, env={},
                              **_drop_privileges())
    except (OSError, subprocess.TimeoutExpired) as err:
        return Isolation(None, f"bwrap cannot run ({err}): no filesystem or network isolation", python)
    if done.returncode != 0 or done.stdout.strip() != "ok":
        why = " ".join((done.stderr or done.stdout).split())[:200]
        return Isolation(None, f"bwrap cannot create namespaces here ({why}): no filesystem or "
                               "network isolation", python)
    return Isolation(path, "", python)


def check_isolation(mode: str) -> Isolation:
    """``require``: :class:`UserError` unless bwrap works; ``best_effort``: one line on stderr
    saying what is missing, then limits only."""
    found = isolation()
    if found.bwrap is None:
        if mode == "require":
            raise UserError(f"config: rollout.sandbox=require but {found.missing} (install it: "
                            "apt-get install bubblewrap; or set rollout.sandbox=best_effort for "
                            "resource limits only)")
        print(f"[tools] python sandbox: {found.missing}; resource limits only "
              "(rollout.sandbox=best_effort)", file=sys.stderr, flush=True)
    return found


def _drop_privileges() -> dict:
    """Popen arguments running the child as ``nobody`` when we are root (the kernel exempts root
    from RLIMIT_NPROC, and root reads every file)."""
    if os.geteuid() != 0:
        return {}
    return {"user": NOBODY, "group": NOBODY, "extra_groups": []}


def _system_links() -> list[str]:
    """``/lib``, ``/lib64``, ``/bin``, ``/sbin``: links into /usr on merged-/usr systems, read-only
    binds elsewhere."""
    argv = []
    for name in ("lib", "lib64", "bin", "sbin"):
        host = Path("/") / name
        if host.is_symlink():
            argv += ["--symlink", os.readlink(host), str(host)]
        elif host.is_dir():
            argv += ["--ro-bind", str(host), str(host)]
    return argv


def _bwrap_argv(bwrap: str, python: str, code_dir: str | None, limits: SandboxLimits) -> list[str]:
    argv = [bwrap, "--ro-bind", "/usr", "/usr", *_system_links()]
    prefix = str(Path(python).parents[1])
    if not prefix.startswith("/usr"):
        argv += ["--ro-bind", prefix, prefix]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(limits.tmp_mb << 20), "--tmpfs", "/tmp"]
    if code_dir is not None:
        argv += ["--ro-bind", code_dir, "/sandbox"]
    argv += ["--unshare-all", "--die-with-parent", "--new-session", "--chdir", "/tmp", "--clearenv"]
    for name, value in INSIDE_ENV.items():
        argv += ["--setenv", name, value]
    return argv + ["--", python, "-I", "-u"]  # unbuffered: prints and tracebacks in order


# Runs first inside the sandbox: limits (hard = soft, which an unprivileged process cannot
# raise; the CPU's hard limit a second later, so the soft one ends the code with SIGXCPU, which
# says which limit it was), then the code as __main__.
_LAUNCHER = """import resource
for which, soft, hard in ((resource.RLIMIT_CPU, {cpu}, {cpu} + 1), (resource.RLIMIT_AS, {memory}, {memory}),
                          (resource.RLIMIT_FSIZE, {fsize}, {fsize}), (resource.RLIMIT_NPROC, {nproc}, {nproc}),
                          (resource.RLIMIT_CORE, 0, 0)):
    resource.setrlimit(which, (soft, hard))
del resource, which, soft, hard
with open({path!r}) as f:
    code = compile(f.read(), "main.py", "exec")
exec(code, {{"__name__": "__main__", "__builtins__": __builtins__}})
"""


def _launcher(limits: SandboxLimits, path: str) -> str:
    return _LAUNCHER.format(cpu=limits.cpu_s, memory=limits.memory_mb << 20,
                            fsize=limits.file_size_mb << 20, nproc=limits.processes, path=path)


def run_python(code: str, limits: SandboxLimits = SandboxLimits(),
               where: Isolation | None = None) -> SandboxRun:
    """Run ``code`` in the sandbox (or, with ``where.bwrap`` None, under the limits only)."""
    where = isolation() if where is None else where
    with tempfile.TemporaryDirectory(prefix="mrlhf-tool-") as host_dir:
        os.chmod(host_dir, 0o755)  # nobody reads the code; only the sandbox's tmpfs is writable
        Path(host_dir, "main.py").write_text(code)
        os.chmod(Path(host_dir, "main.py"), 0o644)
        if where.bwrap is not None:
            argv = _bwrap_argv(where.bwrap, where.python, host_dir, limits)
            argv += ["-c", _launcher(limits, "/sandbox/main.py")]
            return _run(argv, limits, cwd="/", env={}, via_bwrap=True)
        with tempfile.TemporaryDirectory(prefix="mrlhf-tool-work-") as work:
            if os.geteuid() == 0:
                os.chown(work, NOBODY, NOBODY)
            argv = [where.python, "-I", "-u", "-c", _launcher(limits, f"{host_dir}/main.py")]
            return _run(argv, limits, cwd=work, env=dict(INSIDE_ENV, HOME=work), via_bwrap=False)


def _run(argv: list[str], limits: SandboxLimits, cwd: str, env: dict, via_bwrap: bool) -> SandboxRun:
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True,
                            **_drop_privileges())
    output, timed_out, truncated = _read_capped(proc, limits, start)
    if timed_out or truncated:
        _kill_group(proc)
    try:
        code = proc.wait(timeout=max(1.0, limits.wall_s - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:  # output closed but the code still runs
        _kill_group(proc)
        code, timed_out = proc.wait(), True
    _kill_group(proc)  # anything it left in its process group
    # bwrap reports a signalled child as 128 + the signal; a direct child as -signal.
    sig = -code if code < 0 else code - 128 if code > 128 and via_bwrap else 0
    text = output.decode("utf-8", errors="replace")
    return SandboxRun(text, None if timed_out else code, sig, timed_out, truncated,
                      time.monotonic() - start)


def _read_capped(proc: subprocess.Popen, limits: SandboxLimits, start: float) -> tuple[bytes, bool, bool]:
    """Read the child's output as it comes until EOF, the deadline or the byte cap."""
    chunks, size = [], 0
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = limits.wall_s - (time.monotonic() - start)
            if left <= 0:
                return b"".join(chunks), True, False
            if not selector.select(timeout=left):
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                return b"".join(chunks), False, False
            chunks.append(chunk)
            size += len(chunk)
            if size > limits.output_bytes:
                return b"".join(chunks)[: limits.output_bytes], False, True


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
