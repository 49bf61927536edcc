"""Ray worker groups: one torch.distributed world per group, results in rank order, and a dead
or failing rank stops the driver at once with its name instead of a hang."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rlhf.config.ppo_schema import RayConfig
from megatron_rlhf.orchestration.cluster import start_ray, stop_ray
from megatron_rlhf.orchestration.worker_group import WorkerFailed, WorkerGroup, call_together
from tests.orchestration_helpers import Echo, Waiter


@pytest.fixture(scope="module")
def ray_cluster():
    started = start_ray(RayConfig(num_cpus=5, object_store_mb=128), ranks=4, use_gpu=False)
    yield
    stop_ray(started)


def test_group_is_one_world_and_returns_in_rank_order(ray_cluster):
    group = WorkerGroup("echo", 2, use_gpu=False)
    group.build(Echo, "a")
    assert group.call(Echo.whoami) == [("a", 0, 2), ("a", 1, 2)]
    assert group.call(Echo.all_reduce, 1.0) == [3.0, 3.0]  # (1 + 0) + (1 + 1)
    group.shutdown()


def test_dead_worker_fails_fast_with_its_rank(ray_cluster):
    group = WorkerGroup("victims", 2, use_gpu=False)
    group.build(Echo, "b")
    # Rank 0 is left in an all_reduce that cannot finish; a driver that waited for every rank
    # would hang here until the suite's timeout (a failure, not a slow pass).
    with pytest.raises(WorkerFailed, match=r"worker group 'victims' rank 1 failed in die_or_wait"):
        group.call(Echo.die_or_wait, 1)


def test_the_rank_that_died_is_named_not_the_peers_it_broke(ray_cluster):
    group = WorkerGroup("crash", 2, use_gpu=False)
    group.build(Echo, "d")
    died_first = r"rank 1 failed in break_then_die: .*\(rank\(s\) 0 failed too\)"
    with pytest.raises(WorkerFailed, match=died_first):
        group.call(Echo.break_then_die, 1)


def test_a_rank_dying_in_a_call_across_groups_names_its_group(ray_cluster):
    """Two groups meeting in one call (a weight bridge): a rollout rank that dies fails it at
    once, naming the rollout group, though the trainer group is still waiting."""
    trainers = WorkerGroup("actor", 2, use_gpu=False)
    trainers.build(Waiter, "t")
    rollout = WorkerGroup("rollout", 1, use_gpu=False)
    rollout.build(Echo, "r")
    with pytest.raises(WorkerFailed, match=r"^worker group 'rollout' rank 0 failed in die_or_wait"):
        call_together((trainers, Waiter.wait_in_collective), (rollout, Echo.die_or_wait, 0))


def test_worker_exception_names_rank_and_cause(ray_cluster):
    group = WorkerGroup("raisers", 2, use_gpu=False)
    group.build(Echo, "c")
    with pytest.raises(WorkerFailed, match=r"rank 0 failed in fail: ValueError: bad row 7 in shard 3"):
        group.call(Echo.fail, 0)


def test_a_local_cluster_starts_no_idle_workers(ray_cluster):
    """Ours are actors with their own runtime_env, which Ray never gives a prestarted worker: a
    local cluster prestarting one per logical CPU (5 here) only spent a second of CPU on each."""
    import ray

    group = WorkerGroup("one", 1, use_gpu=False)
    group.build(Echo, "e")
    assert group.call(Echo.whoami) == [("e", 0, 1)]
    raylet = ray._private.worker._global_node.all_processes["raylet"][0].process.pid
    children = Path(f"/proc/{raylet}/task/{raylet}/children").read_text().split()
    names = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] for pid in children
             if Path(f"/proc/{pid}").exists()]
    assert b"ray::RankActor" in names, names  # the raylet's children are its workers
    assert not [n for n in names if n.startswith(b"ray::IDLE")], names
    group.shutdown()


PROBE = """
import ray
from megatron_rlhf.config.ppo_schema import RayConfig
from megatron_rlhf.orchestration.cluster import start_ray, stop_ray
started = start_ray(RayConfig(num_cpus=2, object_store_mb=96), ranks=1, use_gpu=False)
print("probe", started, ray.cluster_resources()["CPU"])
stop_ray(started)
"""


def _probe(env: dict, attempts: int = 1) -> str:
    """The probe's line. ``attempts`` > 1 for joining a cluster: on a loaded machine (CI, two
    test files at once) Ray's first connection to a fresh head once missed its 5-second pubsub
    window and then hung (CI 2026-12-07); a second connection is a new client, and a real
    refusal fails every attempt alike."""
    for attempt in range(attempts):
        try:
            out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                                 timeout=120, env=env)
        except subprocess.TimeoutExpired:
            if attempt == attempts - 1:
                raise
            continue
        assert out.returncode == 0, out.stderr[-2000:]
        return next(line for line in out.stdout.splitlines() if line.startswith("probe"))


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_a_run_starts_its_own_cluster_unless_told_to_join_one(tmp_path):
    # `ray start` records its cluster as the host's newest, which Ray's default ray.init() joins:
    # a run on a shared node would land in another job's cluster (and refuse num_cpus).
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    head = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head",
                             f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
                             "--include-dashboard=false", "--block"],
                            env={**env, "RAY_AUTH_MODE": "disabled"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not _listening(port):
            assert head.poll() is None and time.monotonic() < deadline, "ray start --head failed"
            time.sleep(1)
        assert _probe(env) == "probe True 2.0"
        assert head.poll() is None, "the head cluster stopped"
        assert _probe({**env, "RAY_ADDRESS": f"127.0.0.1:{port}", "RAY_AUTH_MODE": "disabled"},
                      attempts=2) == "probe False 1.0"
    finally:
        head.terminate()  # `ray start --block` stops its own processes on SIGTERM
        head.wait(timeout=60)
