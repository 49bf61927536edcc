"""Start a local Ray cluster for this run, or join an existing one (``ray.address``)."""

from __future__ import annotations

import os

from megatron_rlhf.config.ppo_schema import RayConfig
from megatron_rlhf.errors import UserError


def start_ray(cfg: RayConfig, ranks: int, use_gpu: bool) -> bool:
    """Connect the driver; returns True if this call started the cluster (and must stop it).

    A local cluster gets one logical CPU per rank plus one for the driver's tasks, whatever the
    core count: a rank is a process, and threads are set per rank.
    """
    import ray

    if ray.is_initialized():
        return False
    # Workers must import this package the way the driver does.
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join(
        p for p in (os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                    os.environ.get("PYTHONPATH", "")) if p)}}
    address = cfg.address or os.environ.get("RAY_ADDRESS") or None
    if address:
        try:
            ray.init(address=address, runtime_env=env, log_to_driver=True)
        except (ConnectionError, RuntimeError) as err:
            raise UserError(f"ray.address={address}: cannot join the cluster ({err})") from None
        return False
    # "local": Ray's default joins the newest cluster recorded under /tmp/ray (another job's on a
    # shared node, or a test's beside this one), and then refuses num_cpus.
    # No prestarted workers: ours are actors with their own runtime_env, which Ray never hands to a
    # prestarted worker, so those would only import Ray and idle (one per logical CPU).
    ray.init(address="local", num_cpus=cfg.num_cpus or ranks + 1, num_gpus=None if use_gpu else 0,
             object_store_memory=cfg.object_store_mb * 2 ** 20, include_dashboard=False,
             runtime_env=env, log_to_driver=True, configure_logging=False,
             _system_config={"enable_worker_prestart": False,
                             "prestart_worker_first_driver": False})
    return True


def stop_ray(started: bool) -> None:
    import ray

    if started and ray.is_initialized():
        ray.shutdown()
