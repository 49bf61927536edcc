"""The PPO driver behind ``megatron-rlhf ppo`` (also ``python -m megatron_rlhf.ppo``).

    megatron-rlhf ppo --config configs/ppo/tiny_cpu.yaml actor.ppo_epochs=2

The driver starts (or joins) Ray, places the worker groups, and runs :func:`fit`, whose loop is
the whole algorithm: generate -> score -> experience -> advantages -> update -> sync weights.
"""

from __future__ import annotations

import torch

from megatron_rlhf.config.parallel import check_parallel_for_model, layout_of
from megatron_rlhf.config.ppo_checks import uses_critic
from megatron_rlhf.config.ppo_schema import PPOConfig
from megatron_rlhf.errors import UserError
from megatron_rlhf.trainer.ppo_driver import PPORun, Timer, close_step, kl_controller, summarize_rollout
from megatron_rlhf.trainer.ppo_experience import compute_advantages
from megatron_rlhf.trainer.rl_run import check_inputs, finish
from megatron_rlhf.trainer.run_data import reward_scorer, setup_data
from megatron_rlhf.trainer.ppo_worker import PPOWorker


def fit(run: PPORun) -> dict[str, float]:
    """The PPO loop. Every phase is a method of ``run`` or a pure function; ``timing/*`` per phase."""
    cfg, alg = run.cfg, run.cfg.algorithm
    while run.step < run.total_steps:
        timer = Timer()
        _, gens, batch, scored, sampled = run.rollout(run.step, timer)
        sampled |= run.reward_metrics()  # errors, timeouts and extras of the step's calls
        with timer("old_ref_log_prob"):
            sync_check = run.log_probs(batch, gens)
        with timer("adv"):
            adv = compute_advantages(batch, scored["score"], alg, run.kl_ctrl.value, scored["turns"])
            batch.update(advantages=adv["advantages"], returns=adv["returns"])
            run.leave_out_untrained(gens, batch)
        with timer("update_critic"):
            metrics = run.critic.call(PPOWorker.update_critic, batch, run.step)[0] if uses_critic(cfg) else {}
        if run.step >= cfg.trainer.critic_warmup:
            with timer("update_actor"):
                metrics |= run.actor.call(PPOWorker.update_actor, batch, run.step, run.kl_loss_coef)[0]
        reason = run.guard_reason(metrics)
        if reason is not None:
            run.rollback(reason)
            continue
        with timer("sync"):
            run.actor.call(PPOWorker.sync_weights)
        metrics |= run.advance_kl(adv, batch)
        run.step += 1
        metrics |= summarize_rollout(gens, scored, batch, adv) | sync_check | sampled | timer
        shown = {k.split("/")[-1]: metrics[k] for k in ("reward/score_mean", "actor/kl") if k in metrics}
        close_step(run, metrics, len(gens), float(batch["lengths"].sum()), shown)
    return run.history[-1] if run.history else {}


def setup(cfg: PPOConfig) -> PPORun:
    """Ray, worker groups, data, resume: everything :func:`fit` needs."""
    from megatron_rlhf.config.ppo_checks import check_layout, validate_ppo_config
    from megatron_rlhf.orchestration.cluster import start_ray

    validate_ppo_config(cfg)
    check_inputs(cfg)
    rewards = reward_scorer(cfg)
    data = setup_data(cfg, rewards)
    world = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    check_parallel_for_model("actor.parallel", cfg.actor.parallel, data.arch)
    layout = layout_of(cfg.actor.parallel).resolve(world, data.arch.shape)
    check_layout(cfg, world, layout.dp)
    offline = _offline(cfg, data.tokenizer, rewards.needs_ground_truth())
    use_gpu = torch.cuda.is_available()
    separate = cfg.resource_pool.critic == "separate"
    started = start_ray(cfg.ray, world + (cfg.resource_pool.critic_world_size if separate else 0), use_gpu)
    try:
        rewards.start()  # the reward pool: once per run, closed by train_ppo (or below)
        run = _place(cfg, data.arch, layout, world, use_gpu, started, data.total,
                     data.steps_per_epoch, data.train, data.val, data.tokenizer, data.stop_ids,
                     data.report, rewards)
        run.offline = offline
        return run
    except BaseException:
        from megatron_rlhf.orchestration.cluster import stop_ray

        rewards.close()
        stop_ray(started)
        raise


def _offline(cfg: PPOConfig, tokenizer, need_truth: bool) -> list:
    """``data.offline_files`` as groups of samples (when ``data.offline_fraction`` uses them)."""
    if cfg.data.offline_fraction <= 0:
        return []
    from megatron_rlhf.data.offline import load_offline

    d = cfg.data
    groups, report = load_offline(d.offline_files, tokenizer, d.prompt_key, d.ground_truth_key,
                                  d.max_prompt_length, d.max_response_length, need_truth)
    print(f"[ppo] offline responses: {report['samples']} samples in {len(groups)} prompt groups "
          f"from {report['rows']} rows; {report['dropped']} dropped as over-long", flush=True)
    return groups


def _place(cfg, arch, layout, world, use_gpu, started, total, steps_per_epoch, train, val, tokenizer,
           stop_ids, report, rewards) -> PPORun:
    """Worker groups on the Ray cluster: actor (+ critic when shared), or a critic group apart."""
    from megatron_rlhf.config.ppo_checks import check_layout, critic_parallel, optimizer_steps
    from megatron_rlhf.orchestration.worker_group import WorkerGroup

    separate = cfg.resource_pool.critic == "separate"
    updates = optimizer_steps(cfg, total, len(train[:cfg.data.train_batch_size]) * cfg.rollout.n)
    threads = max(1, (torch.get_num_threads() if not use_gpu else 4) // world)
    actor = WorkerGroup("actor", world, use_gpu, threads)
    roles = ("actor",) if separate else ("actor", "critic")
    actor.build(PPOWorker, cfg, roles, layout, updates)
    critic = actor
    if separate:
        size = cfg.resource_pool.critic_world_size
        critic_layout = layout_of(critic_parallel(cfg)).resolve(size, arch.shape)
        check_layout(cfg, size, critic_layout.dp, generates=False)
        critic = WorkerGroup("critic", size, use_gpu, threads)
        critic.build(PPOWorker, cfg, ("critic",), critic_layout, updates)
    run = PPORun(cfg, actor, critic, tokenizer, train, val, stop_ids, rewards.fns.get("fn"),
                 rewards.fns.get("oracle"), total, steps_per_epoch, kl_controller(cfg),
                 ray_started=started, rewards=rewards)
    run.log(f"prompts: {report}; layout {layout}; {world} worker rank(s)"
            f"{f' + {cfg.resource_pool.critic_world_size} critic rank(s)' if separate else ''}; "
            f"{total} steps of {cfg.data.train_batch_size} prompts x {cfg.rollout.n}")
    if rewards.fns:
        where = (f"{rewards.workers} worker process(es), {rewards.timeout_s:g} s per call"
                 if rewards.pool is not None else "in the driver process, no timeout")
        run.log(f"reward functions: {', '.join(sorted({f.spec for f in rewards.fns.values()}))} "
                f"({where})")
    return run


def start(run: PPORun) -> None:
    """Resume (or refuse to overwrite), open the logs, first weight sync, first validation."""
    from megatron_rlhf.checkpoint.train_ckpt import remove_unfinished
    from megatron_rlhf.monitoring import MetricsLogger

    out, t = run.out, run.cfg.trainer
    out.mkdir(parents=True, exist_ok=True)
    for role in run.roles:
        remove_unfinished(run.ckpt_root / role)
    saved = run.checkpoints()
    if t.resume == "disable" and (saved or run.metrics.exists()):
        raise UserError(f"{out} already holds a run; with trainer.resume=disable choose an empty "
                        "trainer.output_dir")
    kept = []
    if saved and t.resume == "auto":
        kept = run.trim_metrics(saved[-1], run.restore(saved[-1]).get("metrics_rows"))
        run.log(f"resumed from step {saved[-1]} ({run.ckpt_root})")
    else:
        run.trim_metrics(-1, rows=0)  # a killed run that never saved starts over: drop its rows
        run.actor.call(PPOWorker.sync_weights)
    run.prepare_offline()  # behaviour log-probs the offline files lack (the starting policy's)
    run.logger = MetricsLogger(str(out), t.logger, run.total_steps, True, start_step=run.step,
                               kept=kept)
    if run.step == 0 and t.val_before_train and run.val:
        run.record({"step": 0, **run.validate(0)})


def train_ppo(cfg: PPOConfig) -> dict[str, float]:
    from megatron_rlhf.config.ppo_checks import validate_ppo_config
    from megatron_rlhf.orchestration.cluster import stop_ray
    from megatron_rlhf.trainer.lifecycle import StopRequest
    from megatron_rlhf.trainer.loop import already_finished

    validate_ppo_config(cfg)
    if already_finished("ppo", cfg):
        return {}
    stop = StopRequest(cfg.trainer, "ppo").install()  # before the long set-up
    run = None
    try:
        run = setup(cfg)
        run.stop = stop.install()  # again: Ray's init took SIGTERM
        start(run)
        fit(run)
        last = finish(run)
        run.log(f"done: {run.step} steps; checkpoints in {run.ckpt_root}")
        return last
    finally:
        if run is not None:
            if run.rewards is not None:
                run.rewards.close()
            if run.logger is not None:
                run.logger.close()
            for group in run.groups():
                group.shutdown()
            stop_ray(run.ray_started)
        stop.uninstall()
