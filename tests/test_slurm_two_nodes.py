"""slurm/ppo_ray.sbatch on a real two-node Slurm cluster made on this machine.

``tools/slurm_two_nodes.sh`` starts a slurmctld and two slurmd, each node in a network namespace
of its own with its own address (10.231.8.11 and .12 behind a private bridge; torn down after),
so Ray, gloo and Slurm's own traffic really cross between two hosts. The PPO actor has one rank
per node. Cases: a run with Ray token authentication on (a client without the token is refused
while it runs; the token file is 0600, never logged, removed at exit); a node that never joins;
stop signals that save and requeue (deterministic ``scancel --signal USR1 --batch``, and a real
``--time`` limit), with MAX_RESTARTS honoured and the resumed run's metrics equal to the
uninterrupted run's; a Ray node killed mid-run (that job, which mostly waits, runs beside the
others: each node has room for two). Skipped, with the reason, where the machine cannot
make network namespaces or run Slurm, except in CI (``CI=true``), where that is a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import missing
from tests.interrupt import steady

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "tools" / "slurm_two_nodes.sh"
SCRIPT = REPO / "slurm" / "ppo_ray.sbatch"
EXIT_CANNOT_START = 3
HEAD = "10.231.8.11"
# One CPU and one (fake) GPU a node: the two actor ranks land one on each node. Not exclusive
# (the scripts ask for whole nodes): the time-limit job runs beside the others.
NODES = ["--nodes=2", "--cpus-per-task=1", "--gpus-per-node=1", "--oversubscribe"]


def _cluster(command: str, env: dict) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["bash", str(CLUSTER), command], capture_output=True, text=True,
                              env=env, timeout=600)
    except subprocess.TimeoutExpired as error:
        stderr = error.stderr.decode(errors="replace") if isinstance(error.stderr, bytes) else error.stderr
        return subprocess.CompletedProcess(error.cmd, -9, "", f"{stderr or ''}\ntimed out after 600 s")


@pytest.fixture(scope="module")
def cluster():
    """The cluster, started here (the script installs Slurm and iproute2 first, as root). Where
    it cannot start, the test skips, except in CI, where that fails naming the reason."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "RAY_")) and k not in ("RANK", "WORLD_SIZE",
                                                                  "MASTER_ADDR", "MASTER_PORT")}
    proc = _cluster("start", env)
    if proc.returncode != 0:
        # Beside another test file on 2 cores a daemon can be slow to come up: one more try,
        # from a clean state (start stops whatever the first attempt left).
        first = proc.stderr.strip()[-1500:]
        proc = _cluster("start", env)
        proc.stderr = f"first attempt:\n{first}\nsecond attempt:\n{proc.stderr}"
    if proc.returncode == EXIT_CANNOT_START:
        missing("a two-node Slurm cluster (tools/slurm_two_nodes.sh start): "
                + (proc.stderr.strip().splitlines() or ["no reason printed"])[-1])
    assert proc.returncode == 0, proc.stderr
    for tool in ("sbatch", "squeue", "scancel", "ip", "tc", "ss"):
        if shutil.which(tool) is None:
            missing(f"{tool} on PATH after tools/slurm_two_nodes.sh start installed its packages")
    env["SLURM_CONF"] = "/tmp/mrl-slurm2/etc/slurm.conf"
    yield env
    _cluster("stop", env)
    for leftover in Path("/tmp").glob("ray_*_[0-9]"):  # the jobs' Ray folders, if any remain
        shutil.rmtree(leftover, ignore_errors=True)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from tests.tiny_models import build_task_workspace

    return build_task_workspace(tmp_path_factory.mktemp("ws2") / "ws", train=64, val=8, seed=0)


def job_env(cluster: dict, ws: Path, tmp: Path, out: Path, steps: int, port: int, **extra) -> dict:
    overrides = (f"actor.model_path={ws / 'base'} "
                 f"data.train_files=[{ws / 'data' / 'prompts_train.parquet'}] data.val_files=[] "
                 "data.max_prompt_length=32 data.max_response_length=8 data.train_batch_size=16 "
                 "actor.ppo_mini_batch_size=8 actor.ppo_micro_batch_size_per_rank=4 "
                 "reward.fn=addition reward.model_path=null critic.model_path=null "
                 "trainer.nnodes=2 trainer.n_gpus_per_node=1 trainer.total_epochs=100 "
                 f"trainer.max_steps={steps} trainer.output_dir={out}")
    return {**cluster, "CONFIG": "configs/ppo/tiny_cpu.yaml", "OVERRIDES": overrides,
            "PYTHON": sys.executable, "LOG_ROOT": str(tmp / "logs"), "OMP_NUM_THREADS": "1",
            "RAY_PORT": str(port), "RAY_WAIT_S": "90", **extra}


def submit(env: dict, log: Path, *flags: str) -> str:
    proc = subprocess.run(["sbatch", "--parsable", f"--output={log}", *NODES, *flags, str(SCRIPT)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def running(job: str, env: dict) -> bool:
    proc = subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True, env=env)
    return proc.returncode == 0 and bool(proc.stdout.strip())


def wait_done(job: str, env: dict, timeout: float) -> float:
    start = time.monotonic()
    while running(job, env):
        if time.monotonic() - start > timeout:
            subprocess.run(["scancel", job], env=env)
            pytest.fail(f"job {job} still running after {timeout:.0f} s")
        time.sleep(1)
    return time.monotonic() - start


def wait_for(path: Path, pattern: str, job: str, env: dict, timeout: float = 420) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, path.read_text()) if path.is_file() else None
        if found:
            return found
        if not running(job, env):
            break
        time.sleep(0.5)
    raise AssertionError(f"{pattern!r} never appeared in {path}:\n"
                         + (path.read_text()[-3000:] if path.is_file() else "(no file)"))


def namespace_processes(grace_s: float = 60.0, beside: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """Command lines of every process inside the two nodes, slurmd aside (and those of the jobs
    ``beside``, still running next to the one checked), once none is left or after ``grace_s``:
    a Ray worker whose raylet was killed exits on its own, but not in the same instant the job
    ends (seen once: a RankActor on the killed node, at the first look)."""
    deadline = time.monotonic() + grace_s
    while True:
        found = {ns: [line for job, line in procs if job not in beside]
                 for ns, procs in _namespace_processes().items()}
        if not any(found.values()) or time.monotonic() > deadline:
            return found
        time.sleep(1)


def _namespace_processes() -> dict[str, list[tuple[str | None, str]]]:
    """(job id, command line) of each process in the two nodes, slurmd aside: the job is the
    step daemon's own (``slurmstepd: [JOB.STEP]``) or the ``SLURM_JOB_ID`` a task inherits, else
    its parent's (Ray's agents rename themselves, which hides their environment)."""
    found = {}
    for ns in ("mrl-n1", "mrl-n2"):
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        procs = {}  # pid -> (parent pid, job id or None, command line)
        for pid in pids.split():
            try:
                line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
            except OSError:
                continue
            step = re.match(r"slurmstepd: \[(\d+)\.", line)
            job = step.group(1) if step else next(
                (v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"SLURM_JOB_ID=")), None)
            procs[pid] = (parent, job, line)
        found[ns] = [(_job_of(pid, procs), line) for pid, (_, _, line) in procs.items()
                     if not line.startswith("slurmd")]
    return found


def _job_of(pid: str, procs: dict) -> str | None:
    for _ in range(len(procs)):
        if pid not in procs:
            return None
        parent, job, _ = procs[pid]
        if job is not None:
            return job
        pid = parent
    return None


AUTH_PROBE = """
import sys, grpc
from ray.core.generated import gcs_service_pb2 as pb, gcs_service_pb2_grpc as rpc
token = sys.stdin.read().strip()
stub = rpc.NodeInfoGcsServiceStub(grpc.insecure_channel(sys.argv[1]))
for name, metadata in (("none", None), ("wrong", [("authorization", "Bearer " + "0" * 64)]),
                       ("right", [("authorization", "Bearer " + token)])):
    try:
        reply = stub.GetAllNodeInfo(pb.GetAllNodeInfoRequest(), timeout=20, metadata=metadata)
        print(name, "OK", len(reply.node_info_list), flush=True)
    except grpc.RpcError as error:
        print(name, error.code().name, error.details(), flush=True)
"""


def probe_gcs_auth(port: int, token: str) -> dict[str, str]:
    """Three calls to the head's GCS from the bridge (another host than the head): no token, a
    wrong one, the job's. Each is bounded (20 s) and answers in milliseconds, so the result does
    not depend on how fast Ray's own client gives up; the call with the token is the control that
    the head was reachable, so a refusal is the token's doing, not the network's."""
    proc = subprocess.run([sys.executable, "-c", AUTH_PROBE, f"{HEAD}:{port}"], input=token,
                          capture_output=True, text=True, timeout=90,
                          env={k: v for k, v in os.environ.items() if not k.startswith("RAY_")})
    answers = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert set(answers) == {"none", "wrong", "right"}, proc.stdout + proc.stderr
    return answers


@pytest.fixture(scope="module")
def time_limit(cluster, workspace, tmp_path_factory):
    """The time-limit job (test_a_time_limit_requeues...), submitted before any other job of
    this file and followed by a thread while the tests before its own run theirs: most of its
    two minutes it waits (for Slurm's signal, then for its requeue), and each node has room for
    two jobs of one CPU and one GPU. Its steps idle too: 1.6 s in their rewards (16 x 0.1 s),
    leaving the CPU to the jobs beside it (no step here is read but the one it saved)."""
    tmp = tmp_path_factory.mktemp("time_limit")
    env = job_env(cluster, workspace, tmp, tmp / "out", steps=100000, port=6616)
    env["OVERRIDES"] += " reward.fn=tests.reward_helpers:slow_addition reward.workers=1"
    job = submit(env, tmp / "job.out", "--time=3", "--signal=B:USR1@90")
    seen: dict = {}
    follower = threading.Thread(target=_follow_time_limit, args=(job, env, tmp / "logs", seen),
                                daemon=True)
    follower.start()
    yield {"job": job, "tmp": tmp, "follower": follower, "seen": seen}
    follower.join(timeout=900)
    subprocess.run(["scancel", job], env=env)


def _follow_time_limit(job: str, env: dict, logs: Path, seen: dict) -> None:
    """Once the second attempt has resumed, SIGKILL node2's raylet of this job; then wait for
    the job to end. What it saw (or the error it met) goes to ``seen``."""
    try:
        seen["resumed"] = wait_for(logs / f"{job}-1" / "driver.log", r"resumed from step (\d+)",
                                   job, env, timeout=420)
        time.sleep(2)
        seen["killed"] = _kill_ray_on("mrl-n2", job)
        wait_done(job, env, timeout=300)  # a hang guard: the script ends the job when a step ends
    except BaseException as error:  # noqa: BLE001 - raised again by the test
        seen["error"] = error
    finally:
        subprocess.run(["scancel", job], env=env)
        deadline = time.monotonic() + 120
        while running(job, env) and time.monotonic() < deadline:
            time.sleep(1)


@pytest.fixture(scope="module")
def uninterrupted(cluster, workspace, time_limit, tmp_path_factory):
    """12 steps with the actor over both nodes, token authentication on, nothing interrupted."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    out, port = tmp / "out", 6611
    env = job_env(cluster, workspace, tmp, out, steps=12, port=port)
    job = submit(env, tmp / "job.out", "--time=10")
    attempt = tmp / "logs" / f"{job}-0"
    wait_for(attempt / "ray-wait.log", r"Ray cluster up", job, env)
    token_file = attempt / "ray" / "auth_token"
    mode, token = token_file.stat().st_mode & 0o777, token_file.read_text()
    auth = probe_gcs_auth(port, token.strip())
    listening = subprocess.run(["ip", "netns", "exec", "mrl-n1", "ss", "-Hltn"],
                               capture_output=True, text=True).stdout
    wait_done(job, env, timeout=600)
    return {"out": out, "log": (tmp / "job.out").read_text(), "attempt": attempt, "mode": mode,
            "token": token, "token_file": token_file, "auth": auth, "listening": listening,
            "tmp": tmp}


def test_ppo_spans_both_nodes_with_ray_token_authentication(uninterrupted, time_limit):
    run = uninterrupted
    assert "[ppo] done: 12 steps" in run["log"] and "[ppo_ray] finished" in run["log"], run["log"]
    # One actor rank on the worker node (Ray prefixes its lines with the node's address).
    assert re.search(r"RankActor pid=\d+, ip=10\.231\.8\.12", run["log"]), run["log"]
    assert re.search(r"Ray cluster up: 2 nodes, 2 GPUs", run["log"])
    # While the job ran, the head refused a client without the token or with a wrong one, and
    # answered the same call from the same host with the token (so it was reachable).
    auth = run["auth"]
    assert auth["right"].startswith("OK "), auth
    for name in ("none", "wrong"):
        assert auth[name].startswith("UNAUTHENTICATED"), auth
    # The token: only the job's user can read it, it left with the job, it is in no log.
    assert run["mode"] == 0o600 and re.fullmatch(r"[0-9a-f]{64}", run["token"])
    assert not run["token_file"].exists()
    logs = [run["log"]] + [p.read_text(errors="replace") for p in run["attempt"].rglob("*")
                           if p.is_file()]
    assert not any(run["token"] in text for text in logs)
    # No dashboard: nothing listens on its port, on any address.
    assert ":8265" not in run["listening"], run["listening"]
    assert namespace_processes(beside=(time_limit["job"],)) == {"mrl-n1": [], "mrl-n2": []}


def test_a_node_that_never_joins_fails_the_job_naming_it(cluster, workspace, time_limit, tmp_path):
    """node2's packets to the head's Ray port are held back (an 8 bit/s traffic class, as a
    firewall would drop them): its Ray worker never joins."""
    port, ns = 6612, ["ip", "netns", "exec", "mrl-n2", "tc"]
    setup = [["qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "10",
              "r2q", "1"],
             ["class", "add", "dev", "eth0", "parent", "1:", "classid", "1:10", "htb", "rate",
              "1gbit"],
             ["class", "add", "dev", "eth0", "parent", "1:", "classid", "1:20", "htb", "rate",
              "8bit", "ceil", "8bit", "burst", "1", "cburst", "1"],
             ["filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
              "match", "ip", "dst", f"{HEAD}/32", "match", "ip", "dport", str(port), "0xffff",
              "flowid", "1:20"]]
    for args in setup:
        proc = subprocess.run(ns + args, capture_output=True, text=True)
        if proc.returncode:
            subprocess.run(ns + ["qdisc", "del", "dev", "eth0", "root"], capture_output=True)
            missing(f"tc holding traffic back in a network namespace: {proc.stderr.strip()}")
    try:
        env = job_env(cluster, workspace, tmp_path, tmp_path / "out", steps=4, port=port,
                      RAY_WAIT_S="15")
        job = submit(env, tmp_path / "job.out", "--time=10")
        wait_done(job, env, timeout=300)  # a hang guard: RAY_WAIT_S=15 is the script's own bound
    finally:
        subprocess.run(ns + ["qdisc", "del", "dev", "eth0", "root"], capture_output=True)
    log = (tmp_path / "job.out").read_text()
    lines = [line for line in log.splitlines() if "error:" in line]
    assert len(lines) == 1, log
    assert "never joined: node2 (10.231.8.12)" in lines[0] and "1 of 2 nodes" in lines[0], log
    assert not (tmp_path / "out" / "checkpoints").exists()
    assert namespace_processes(beside=(time_limit["job"],)) == {"mrl-n1": [], "mrl-n2": []}


def _kill_ray_on(ns: str, job: str) -> int:
    """SIGKILL to ``job``'s raylet in node ``ns`` (another job's Ray may run beside it)."""
    killed = 0
    for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                              text=True).stdout.split():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"raylet/raylet" in cmdline and f"SLURM_JOB_ID={job}".encode() in environ:
            os.kill(int(pid), 9)
            killed += 1
    return killed


def test_stop_signals_save_requeue_and_resume_as_the_uninterrupted_run(
        cluster, workspace, uninterrupted, time_limit, tmp_path):
    """USR1 to the batch shell (what --signal=B:USR1 sends) on the first attempt: save, requeue;
    again on the second: save, but MAX_RESTARTS=1 allows no further requeue (exit 75). The
    same job submitted again finishes, and every metrics row equals the uninterrupted run's."""
    out = tmp_path / "out"
    env = job_env(cluster, workspace, tmp_path, out, steps=12, port=6614, MAX_RESTARTS="1")
    job = submit(env, tmp_path / "job.out", "--time=10")
    logs = tmp_path / "logs"
    wait_for(logs / f"{job}-0" / "driver.log", r"reward functions", job, env)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True)
    first = wait_for(logs / f"{job}-1" / "driver.log", r"resumed from step (\d+)", job, env)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True)
    wait_done(job, env, timeout=240)
    log = (tmp_path / "job.out").read_text()
    assert "requeueing (restart 1 of 1)" in log, log
    assert "restart 1 of MAX_RESTARTS=1: not requeued" in log, log
    assert not (logs / f"{job}-2").exists()
    second = re.findall(r"stopped at step (\d+)", log)
    assert len(second) == 2 and int(second[0]) == int(first.group(1)) >= 1, log

    again = subprocess.run(["sbatch", "--wait", f"--output={tmp_path / 'again.out'}", *NODES,
                            "--time=10", str(SCRIPT)], capture_output=True, text=True,
                           env={**env, "RAY_PORT": "6615"}, cwd=REPO, timeout=300)
    text = (tmp_path / "again.out").read_text()
    assert again.returncode == 0, text
    assert f"resumed from step {second[1]}" in text and "[ppo] done: 12 steps" in text, text
    assert steady(out) == steady(uninterrupted["out"])
    assert len(steady(out)) == 12


def test_a_time_limit_requeues_and_a_ray_node_killed_later_ends_the_job(time_limit):
    """A real limit: --time=3 with the signal 90 s before it (Slurm sends it up to ~25 s earlier
    still): the run saves, the job requeues and the second attempt resumes from that step. Then
    node2's raylet is killed mid-run: the job ends naming that Ray step (the script waits on every
    step and ends the job when one ends first; no clock is asserted on a shared machine), and a
    failure is not requeued. The job ran beside the jobs of the tests before this one (the
    ``time_limit`` fixture); once it has ended, nothing of any job is left on either node."""
    follower, seen, tmp = time_limit["follower"], time_limit["seen"], time_limit["tmp"]
    follower.join(timeout=900)
    assert not follower.is_alive(), "the time-limit job's follower still waits after 900 s"
    if "error" in seen:
        raise seen["error"]
    assert seen["killed"] == 1
    logs = tmp / "logs"
    first = (logs / f"{time_limit['job']}-0" / "driver.log").read_text()
    saved = re.search(r"stopped at step (\d+) \(SIGUSR1 received\)", first)
    assert saved, first
    assert int(seen["resumed"].group(1)) == int(saved.group(1)) >= 1
    log = (tmp / "job.out").read_text()
    assert "SIGUSR1: asking the run to save and stop" in log
    assert "stopped to be resumed: requeueing (restart 1 of 3)" in log
    assert re.search(r"step ray-node2 ended \(exit code \d+\) before driver: ending the job", log), log
    assert "failed (exit code 1): not requeued" in log
    assert not (logs / f"{time_limit['job']}-2").exists()
    assert namespace_processes() == {"mrl-n1": [], "mrl-n2": []}


def test_train_rm_over_both_nodes_stops_requeues_and_ends_as_one_local_run(cluster, workspace,
                                                                            tmp_path):
    """train_rm.sbatch, one rank a node: USR1 to the batch shell stops every rank at one step
    boundary (exit 75 from each), the job requeues, resumes and finishes; every metrics row
    equals a two-rank run on one machine (gloo's sum of two ranks is the same sum)."""
    ws = workspace

    def overrides(out: Path) -> list[str]:
        return [f"model.path={ws / 'base'}", f"data.train_files=[{ws / 'data' / 'prefs_train.parquet'}]",
                "data.val_files=[]", f"trainer.output_dir={out}", "data.train_batch_size=8",
                "data.micro_batch_size_per_rank=4", "data.max_prompt_length=24",
                "data.max_response_length=16", "trainer.max_steps=24", "trainer.logger=console",
                "trainer.log_every_steps=4", "trainer.save_every_steps=0",
                "trainer.eval_every_steps=0"]

    out = tmp_path / "slurm"
    env = {**cluster, "CONFIG": "configs/rm/tiny_cpu.yaml", "OVERRIDES": " ".join(overrides(out)),
           "PYTHON": sys.executable, "LOG_ROOT": str(tmp_path / "logs"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path / 'job.out'}",
                           "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1",
                           "--gpus-per-node=1", "--time=10", str(REPO / "slurm" / "train_rm.sbatch")],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip()
    local = subprocess.Popen([sys.executable, "-m", "megatron_rlhf.cli", "train-rm", "--config",
                              "configs/rm/tiny_cpu.yaml", *overrides(tmp_path / "local"),
                              "--nproc-per-node", "2"], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    wait_for(tmp_path / "logs" / f"{job}-0" / "train-rm.log", r"step 4/", job, env)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True)
    wait_done(job, env, timeout=300)
    local_out, _ = local.communicate(timeout=600)
    assert local.returncode == 0, local_out[-3000:]
    log = (tmp_path / "job.out").read_text()
    assert "2 rank(s), rendezvous node1:" in log
    assert len(re.findall(r"Exited with exit code 75", log)) == 2, log  # both ranks, one boundary
    assert "stopped to be resumed: requeueing (restart 1 of 3)" in log, log
    assert re.search(r"resumed from .*\(step \d+\)", log) and "[train_rm] finished" in log, log
    assert steady(out) == steady(tmp_path / "local") and len(steady(out)) >= 6
