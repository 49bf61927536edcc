"""The RL driver behind ``megatron-rlhf ppo`` (also ``python -m megatron_rlhf.ppo``), for one
agent or many.

    megatron-rlhf ppo --config configs/ppo/tiny_cpu.yaml actor.ppo_epochs=2

The driver starts (or joins) Ray, places the worker groups (:mod:`placement`), and runs
:func:`fit`, whose loop is the whole algorithm: the play mode generates and scores (one agent:
its own rollout), then each agent that played: experience -> advantages -> updates; then every
weight sync.
"""

from __future__ import annotations

import time

from megatron_rlhf.config.ppo_schema import PPOConfig
from megatron_rlhf.errors import UserError
from megatron_rlhf.trainers.rl.placement import setup, shutdown
from megatron_rlhf.trainers.rl.agent import Timer, close_step
from megatron_rlhf.trainers.rl.routing import check_routing_replay
from megatron_rlhf.trainers.rl.policy import policy_is_moe
from megatron_rlhf.trainers.rl.ahead import busy_fractions
from megatron_rlhf.trainers.rl.run import RLRun, finish


def fit(run: RLRun) -> dict[str, float]:
    """The RL loop. Every phase is a method of ``run``, its mode or its agents; ``timing/*``
    per phase."""
    while run.step < run.total_steps:
        timer, started = Timer(), time.time()
        episodes, metrics = run.mode.play(run, run.step, timer)  # generate, score
        metrics |= run.reward_metrics()  # errors, timeouts and extras of the step's calls
        updates = {name: run.update(name, episode, timer) for name, episode in episodes.items()}
        run.check_tables(updates, metrics)
        bad = run.guard(updates)
        if bad is not None:
            run.rollback(*bad)
            continue
        with timer("sync"):
            for name in episodes:
                metrics |= run.named(name, run.agents[name].sync_weights(run.step + 1))
        for name, u in updates.items():  # the KL controllers move on accepted steps only
            kl = run.agents[name].advance_kl(u.advantages, episodes[name].batch)
            metrics |= run.named(name, u.metrics | kl)
        run.step += 1
        metrics |= timer
        separate = run.cfg.rollout.placement == "separate"
        metrics |= busy_fractions(metrics, time.time() - started, separate)
        close_step(run, metrics, sum(len(e.gens) for e in episodes.values()),
                   float(sum(e.batch["lengths"].sum() for e in episodes.values())), run.shown(metrics))
    return run.history[-1] if run.history else {}


def start(run: RLRun) -> None:
    """Resume from the newest step every agent has (or refuse to overwrite), open the logs,
    first weight sync, first validation."""
    from megatron_rlhf.checkpoint.train_ckpt import remove_unfinished
    from megatron_rlhf.monitoring import MetricsLogger

    out, t = run.out, run.cfg.trainer
    out.mkdir(parents=True, exist_ok=True)
    for agent in run.agents.values():
        for role in agent.roles:
            remove_unfinished(agent.ckpt_root / role)
    saved = run.checkpoints()
    alone = {name: a.checkpoints() for name, a in run.agents.items() if a.checkpoints()}
    if t.resume == "auto" and alone and not saved:
        raise UserError(f"{out}: agents {', '.join(sorted(alone))} have checkpoints but no step is "
                        "common to every agent (was the agent list changed?); resuming would "
                        "start over and prune them. Choose another trainer.output_dir")
    if t.resume == "disable" and (saved or run.metrics.exists()):
        raise UserError(f"{out} already holds a run; with trainer.resume=disable choose an empty "
                        "trainer.output_dir")
    kept = []
    if saved and t.resume == "auto":
        kept = run.restore(saved[-1])
        where = next(iter(run.agents.values())).ckpt_root if run.single else out / "agents"
        run.log(f"resumed {'' if run.single else 'every agent '}from step {saved[-1]} ({where})")
    else:
        run.trim_metrics(-1, rows=0)  # a killed run that never saved starts over: drop its rows
        for agent in run.agents.values():
            agent.sync_weights(run.step)
    for agent in run.agents.values():
        path = agent.cfg.actor.model_path
        check_routing_replay(agent.cfg.actor.router_replay, path, policy_is_moe(path),
                             bool(agent.offline), agent.log)
        agent.prepare_offline()  # behaviour log-probs the offline files lack (the starting policy's)
    run.logger = MetricsLogger(str(out), t.logger, run.total_steps, True, start_step=run.step,
                               kept=kept)
    if run.step == 0 and t.val_before_train and next(iter(run.agents.values())).val:
        run.record({"step": 0, **run.validate(0)})


def train_ppo(cfg: PPOConfig) -> dict[str, float]:
    """``megatron-rlhf ppo``: set up, resume, train, save, validate."""
    from megatron_rlhf.orchestration.cluster import stop_ray
    from megatron_rlhf.trainers.lifecycle import StopRequest
    from megatron_rlhf.trainers.loop import already_finished

    from megatron_rlhf.config.agents import check_agents
    from megatron_rlhf.config.ppo_checks import validate_ppo_config

    if cfg.agents:
        check_agents(cfg)  # first: an agent list that makes no sense says so before the rest
    validate_ppo_config(cfg)
    label = "multi-agent" if len(cfg.agents) > 1 else "ppo"
    if already_finished(label, cfg):
        return {}
    stop = StopRequest(cfg.trainer, label).install()  # before the long set-up
    run = None
    try:
        run = setup(cfg)
        run.stop = stop.install()  # again: Ray's init took SIGTERM
        start(run)
        fit(run)
        last = finish(run)
        where = run.out / ("checkpoints" if run.single else "agents/<name>/checkpoints")
        run.log(f"done: {run.step} steps; checkpoints in {where}")
        return last
    finally:
        if run is not None:
            shutdown(run)
            stop_ray(run.ray_started)
        stop.uninstall()
