"""Rank discovery (torchrun or Slurm), process-group start-up, and the local multi-process launcher.

The same entry point runs unchanged under ``torchrun``, under ``srun`` and as a plain single
process; ``--nproc-per-node K`` on the CLI re-launches it K times through torch elastic.
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import uuid
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rlhf.distributed.platform import apply_platform, platform_is_cpu
from megatron_rlhf.errors import UserError

DEFAULT_PORT = 29500


def quiet_cpu_warnings() -> None:
    """Silence what every CPU process would otherwise print first (the CLI and Ray workers)."""
    # megatron-core warns about every missing GPU-only package; on CPU that is expected noise.
    for module in ("megatron", "torch.distributed"):
        warnings.filterwarnings("ignore", category=UserWarning, module=module)
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)
    warnings.filterwarnings("ignore", message="Please use DTensor instead")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm" or "single"


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list: ``"gpu[003-010,012],cpu1"`` -> ``"gpu003"``,
    ``"rack[1-2]-node[01-04]-ib"`` -> ``"rack1-node01-ib"``."""
    nodelist = nodelist.strip()
    if not nodelist:
        raise UserError("SLURM_JOB_NODELIST is empty")
    depth, end = 0, len(nodelist)
    for index, char in enumerate(nodelist):  # the first entry ends at a comma outside brackets
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0 or depth > 1:
            break
        if char == "," and depth == 0:
            end = index
            break
    entry = nodelist[:end]
    # Each bracket group stands for its first value.
    host = re.sub(r"\[([^\[\]]+)\]", lambda m: m.group(1).split(",")[0].split("-")[0], entry)
    if depth < 0 or depth > 1 or not host or "[" in host or "]" in host:
        raise UserError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}")
    return host


def discover_rank(env: dict[str, str] | None = None) -> RankInfo:
    """Read rank variables: torchrun's first, then Slurm's, else a single process."""
    env = dict(os.environ) if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return RankInfo(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", DEFAULT_PORT)),
            source="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        job_id = int(env.get("SLURM_JOB_ID", "0"))
        # Derive the port from the job id so concurrent jobs sharing a node do not collide.
        port = int(env.get("MASTER_PORT", 20000 + job_id % 20000))
        return RankInfo(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_JOB_NODELIST", "")),
            master_port=port,
            source="slurm",
        )
    return RankInfo(0, 1, 0, "127.0.0.1", int(env.get("MASTER_PORT", 0) or 0), "single")


def _free_port() -> int:
    return free_port("127.0.0.1")


# Below Linux's ephemeral range (32768-60999), where outgoing connections take their local
# ports, and above Ray's worker ports (10002-19999): a port found free here stays free until
# the store that asked for it listens (one from the ephemeral range was once taken in between).
PORT_RANGE = (20000, 32000)


def free_port(host: str = "") -> int:
    """A port nothing listens on at ``host``, for a rendezvous store about to listen there."""
    import random
    import socket

    rng = random.Random()  # not the training seed: two runs on a node must not pick alike
    for _ in range(200):
        port = rng.randrange(*PORT_RANGE)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # a crowded range: let the OS choose
        sock.bind((host, 0))
        return sock.getsockname()[1]


def init_distributed(timeout_minutes: int = 30) -> RankInfo:
    """Start the default process group: ``nccl`` on GPU, ``gloo`` on CPU (with the CPU bridge).

    Idempotent: a second call returns the already-running world's info.
    """
    info = discover_rank()
    apply_platform()
    if dist.is_initialized():
        return info
    _die_with_launcher()
    port = info.master_port or _free_port()
    if torch.cuda.is_available():
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
    backend = "gloo" if platform_is_cpu() else "nccl"
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{info.master_addr}:{port}",
        rank=info.rank,
        world_size=info.world_size,
        timeout=datetime.timedelta(minutes=timeout_minutes),
    )
    return info


def _die_with_launcher() -> None:
    """torch elastic (torchrun, ``--nproc-per-node``) starts each rank in a session of its own,
    so a launcher killed outright (SIGKILL, the OOM killer, a closed terminal's group kill) would
    leave its ranks training on, writing the run's folder while a relaunch starts beside them.
    On Linux they are made to die with it instead."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1  # <linux/prctl.h>
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0):
        return  # not permitted here: the ranks outlive a killed launcher, as torchrun's do
    if os.getppid() == 1:  # the launcher died before the request was made
        os._exit(1)


def inside_launch() -> bool:
    """True when this process was started by torchrun, srun or our own launcher."""
    return discover_rank().source != "single"


def relaunch(nproc_per_node: int, argv: list[str]) -> int:
    """Run ``python -m megatron_rlhf.cli *argv`` as ``nproc_per_node`` local ranks (torch elastic).

    Returns the exit code: 0, or the first failing rank's code (75: stopped cleanly, to be
    resumed). Each rank prints its own clean error.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    threads = max(1, (os.cpu_count() or 1) // nproc_per_node)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc_per_node,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=0,
        monitor_interval=0.1,
    )
    previous = _forward_user_signals()
    try:
        elastic_launch(config, sys.executable)("-m", "megatron_rlhf.cli", *argv)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        print(f"error: rank {rank} of {nproc_per_node} failed (exit code {failure.exitcode})",
              file=sys.stderr)
        return failure.exitcode or 1
    finally:
        import signal

        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    return 0


def _forward_user_signals() -> dict:
    """SIGUSR1/SIGUSR2 to this launcher (a batch script's warning before the time limit) go to
    the ranks, which stop cleanly; torch elastic forwards SIGTERM itself (and kills the ranks
    30 s later). Returns the handlers it replaced."""
    import signal

    import psutil

    def forward(signum, _frame):
        for child in psutil.Process().children():
            try:
                child.send_signal(signum)
            except psutil.Error:  # already gone
                pass

    return {sig: signal.signal(sig, forward) for sig in (signal.SIGUSR1, signal.SIGUSR2)}
