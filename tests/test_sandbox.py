"""The python tool's sandbox against hostile code: each attempt is contained, and each test says
which limit or isolation stopped it. Needs bubblewrap (tools/in_venv.sh installs it as root);
in CI a missing bwrap fails these tests instead of skipping them."""

import os
import socket
import subprocess
import sys
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_rlhf.agent_tools.executor import ToolSession
from megatron_rlhf.agent_tools.parsers import Call
from megatron_rlhf.agent_tools.sandbox import (INSIDE_ENV, Isolation, SandboxLimits, isolation,
                                               run_python)
from megatron_rlhf.agent_tools.spec import load_tools
from tests.conftest import missing

REPO = Path(__file__).resolve().parents[1]
LIMITS = SandboxLimits(wall_s=10, cpu_s=2, memory_mb=256, file_size_mb=1, processes=16)


@pytest.fixture(scope="module")
def sandbox():
    found = isolation()
    if found.bwrap is None:
        missing(f"bubblewrap: {found.missing} (apt-get install bubblewrap)")
    return found


def test_ordinary_code_runs_with_a_cleared_environment(sandbox, monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    run = run_python("import os\nprint(2**10)\nprint(sorted(os.environ))", LIMITS, sandbox)
    assert run.exit_code == 0 and not run.timed_out and not run.truncated
    first, second = run.output.splitlines()
    assert first == "1024"
    assert eval(second) == sorted([*INSIDE_ENV, "PWD"])  # nothing of ours: no SECRET_TOKEN
    assert "hunter2" not in run.output


def test_a_secret_beside_the_run_is_invisible(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the launch codes")
    code = (f"import os\nfor p in [{str(secret)!r}, {str(tmp_path)!r}, '/root', '/etc/passwd', "
            "'/work']:\n    try:\n        print(p, os.listdir(p) if os.path.isdir(p) else open(p).read())\n"
            "    except OSError as e:\n        print(p, type(e).__name__)\nprint(sorted(os.listdir('/')))")
    run = run_python(code, LIMITS, sandbox)
    # Isolation: the mount namespace holds only the runtime's read-only binds.
    assert "the launch codes" not in run.output
    for path in (secret, tmp_path, "/root", "/etc/passwd", "/work"):
        assert f"{path} FileNotFoundError" in run.output
    assert run.output.splitlines()[-1] == str(sorted(["bin", "dev", "lib", "lib64", "proc",
                                                     "sandbox", "sbin", "tmp", "usr"]))


def test_writes_outside_its_tmp_change_nothing(sandbox, tmp_path):
    target, marker = tmp_path / "planted.txt", f"/tmp/planted-{uuid.uuid4().hex}"
    code = (f"import os\nfor p in [{str(target)!r}, '/usr/planted', '/sandbox/main.py']:\n"
            "    try:\n        open(p, 'w').write('x')\n        print(p, 'written')\n"
            "    except OSError as e:\n        print(p, type(e).__name__)\n"
            f"print(os.system('touch {marker} && echo touched'))\n"
            "open('/tmp/mine.txt', 'w').write('ok'); print(open('/tmp/mine.txt').read())")
    run = run_python(code, LIMITS, sandbox)
    # Isolation: the host path does not exist inside; /usr and the code are read-only binds; the
    # tmpfs at /tmp is its own and gone after.
    assert f"{target} FileNotFoundError" in run.output
    assert "/usr/planted OSError" in run.output and "/sandbox/main.py OSError" in run.output
    assert "touched\n0\nok" in run.output  # the shell ran and wrote into its own /tmp ...
    assert not target.exists() and not Path(marker).exists()  # ... and nothing outside changed


def test_no_network_local_or_public(sandbox):
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    port = server.getsockname()[1]
    code = (f"import socket\nfor address in [('127.0.0.1', {port}), ('1.1.1.1', 53), "
            "('8.8.8.8', 443)]:\n    s = socket.socket()\n    s.settimeout(3)\n    try:\n"
            "        s.connect(address)\n        print(address, 'connected')\n"
            "    except OSError as e:\n        print(address, e.errno)\n"
            "import subprocess\nprint(open('/proc/net/dev').read().count(':'))")
    run = run_python(code, LIMITS, sandbox)
    # Isolation: its own network namespace, where even loopback is down: our listener is not
    # reached (ECONNREFUSED or ENETUNREACH) and public addresses have no route (ENETUNREACH, at
    # once: no packet is sent; a 3 s timeout would say "timed out", not 101).
    lines = run.output.splitlines()
    assert lines[0] in (f"('127.0.0.1', {port}) 111", f"('127.0.0.1', {port}) 101"), run.output
    assert lines[1:3] == ["('1.1.1.1', 53) 101", "('8.8.8.8', 443) 101"], run.output
    with pytest.raises(BlockingIOError):
        server.accept()  # nothing ever connected
    server.close()
    assert lines[3] == "1"  # one interface (lo), down


@pytest.mark.timeout(120, method="thread")  # a sandbox that waits for its sleepers fails here
def test_a_fork_bomb_hits_the_process_limit(sandbox):
    code = ("import os, time\nn = 0\ntry:\n    for _ in range(1000):\n        if os.fork() == 0:\n"
            "            time.sleep(60)\n            os._exit(0)\n        n += 1\n"
            "except OSError as e:\n    print('stopped after', n, e.errno)")
    run = run_python(code, LIMITS, sandbox)
    # RLIMIT_NPROC (16, counted in its own user namespace): fork fails with EAGAIN; when the
    # code ends, bwrap's PID namespace takes its sleeping children down with it.
    assert run.output.startswith("stopped after ") and run.output.split()[-1] == "11", run.output
    assert int(run.output.split()[2]) < LIMITS.processes
    assert not run.timed_out  # ended by itself inside the 10 s wall limit: sleepers not waited for


@pytest.mark.timeout(240, method="thread")  # a wall-clock limit that never fires fails here
def test_an_endless_loop_hits_the_cpu_limit_and_a_sleeper_the_wall_clock(sandbox):
    # A wall-clock limit far above the CPU limit: SIGXCPU comes first however loaded the machine.
    run = run_python("while True:\n    pass", replace(LIMITS, wall_s=120), sandbox)
    assert run.signal == 24 and not run.timed_out  # SIGXCPU: RLIMIT_CPU (2 s)
    assert LIMITS.cpu_s <= run.seconds
    run = run_python("import time\ntime.sleep(60)\nprint('woke')", SandboxLimits(wall_s=1.5), sandbox)
    assert run.timed_out and run.exit_code is None  # the wall-clock timeout killed the group
    assert "woke" not in run.output  # before the sleep ended


def test_memory_and_file_size_limits(sandbox):
    run = run_python("x = bytearray(512 * 2**20)", LIMITS, sandbox)
    assert run.exit_code == 1 and run.output.rstrip().endswith("MemoryError")  # RLIMIT_AS 256 MiB
    run = run_python("open('/tmp/big', 'wb').write(b'x' * (4 * 2**20))", LIMITS, sandbox)
    assert "[Errno 27] File too large" in run.output  # RLIMIT_FSIZE 1 MiB (Python ignores SIGXFSZ)
    run = run_python("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))",
                     LIMITS, sandbox)
    assert "ValueError: not allowed to raise maximum limit" in run.output  # hard limits hold


def test_megabytes_of_output_are_cut_to_the_budget_quickly(sandbox):
    run = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)",
                     replace(LIMITS, wall_s=120), sandbox)
    # The output cap: read incrementally, the process killed once past it (not by the clock).
    assert run.truncated and len(run.output) == LIMITS.output_bytes and set(run.output) == {"x"}
    assert not run.timed_out


def test_the_python_tool_reports_each_stop_to_the_policy(sandbox):
    tools = load_tools([{"name": "python", "timeout_s": 2},
                        {"name": "terse", "fn": "python", "max_response_tokens": 8}])
    calls = [Call("python", {"code": "print(6 * 7)"}), Call("python", {"code": "while True: pass"}),
             Call("terse", {"code": "print('y' * 10**6)"}), Call("python", {"code": "1/0"})]
    with ToolSession(tools, workers=4) as session:
        ok, spin, loud, fail = session.run_round(calls)
    assert ok.text == "42\n" and not ok.error
    # The CPU limit equals the timeout, so one thread's loop meets the wall clock first (the CPU
    # limit is the backstop for code burning several cores).
    assert spin.timeout and spin.error and spin.text == "Error: timed out after 2 s"
    assert loud.truncated and loud.text == "y" * 64 and not loud.error  # 8 tokens x 8 bytes
    assert fail.error and "ZeroDivisionError" in fail.text


def test_without_bwrap_require_stops_and_best_effort_keeps_the_limits(tmp_path):
    env = {"PATH": str(tmp_path), "PYTHONPATH": str(REPO), "HOME": str(tmp_path)}
    probe = ("from megatron_rlhf.agent_tools.sandbox import check_isolation, run_python, "
             "SandboxLimits\nimport sys\nmode = sys.argv[1]\nfound = check_isolation(mode)\n"
             "run = run_python('import os\\nprint(os.getcwd(), os.path.exists(\"/usr\"))\\n"
             "x = bytearray(512 * 2**20)', SandboxLimits(memory_mb=256), found)\n"
             "print(run.output.splitlines()[0], run.output.rstrip().endswith('MemoryError'))")
    done = subprocess.run([sys.executable, "-c", probe, "require"], env=env, capture_output=True,
                          text=True, cwd=tmp_path, timeout=60)
    assert done.returncode == 1
    assert ("UserError: config: rollout.sandbox=require but bwrap (bubblewrap) is not installed"
            in done.stderr)
    done = subprocess.run([sys.executable, "-c", probe, "best_effort"], env=env,
                          capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == ("[tools] python sandbox: bwrap (bubblewrap) is not installed: "
                                   "no filesystem or network isolation; resource limits only "
                                   "(rollout.sandbox=best_effort)")
    cwd, sees_usr, memory_error = done.stdout.split()
    # Limits only: a fresh working directory and the memory limit, but the host's files show.
    assert "mrlhf-tool-work-" in cwd and sees_usr == "True" and memory_error == "True"


def test_isolation_is_probed_as_the_user_the_code_runs_as():
    found = isolation()
    assert isinstance(found, Isolation)
    assert (found.bwrap is None) == bool(found.missing)
    if os.geteuid() != 0:
        missing("root: code runs as nobody only when the trainer is root (tools/in_venv.sh)")
    if found.bwrap is None:
        missing(f"bubblewrap able to isolate code ({found.missing})")
    run = run_python("import os\nprint(os.getuid(), os.getgid(), os.getgroups())", LIMITS, found)
    assert run.output.split()[:2] == ["65534", "65534"]  # nobody: root is exempt from NPROC
