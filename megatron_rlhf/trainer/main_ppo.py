"""The PPO driver behind ``megatron-rlhf ppo`` (also ``python -m megatron_rlhf.ppo``).

    megatron-rlhf ppo --config configs/ppo/tiny_cpu.yaml actor.ppo_epochs=2

The driver starts (or joins) Ray, places the worker groups, and runs :func:`fit`, whose loop is
the whole algorithm: generate -> score -> experience -> advantages -> update -> sync weights.
"""

from __future__ import annotations

import torch

from megatron_rlhf.config.parallel import check_parallel_for_model, layout_of
from megatron_rlhf.config.ppo_schema import PPOConfig
from megatron_rlhf.errors import UserError
from megatron_rlhf.trainer.ppo_driver import PPORun, Timer, kl_controller, summarize_rollout
from megatron_rlhf.trainer.ppo_experience import compute_advantages


def fit(run: PPORun) -> dict[str, float]:
    """The PPO loop. Every phase is a method of ``run`` or a pure function; ``timing/*`` per phase."""
    cfg, alg = run.cfg, run.cfg.algorithm
    while run.step < run.total_steps:
        timer = Timer()
        _, gens, batch, scored, sampled = run.rollout(run.step, timer)
        with timer("old_ref_log_prob"):
            sync_check = run.log_probs(batch, gens)
        with timer("adv"):
            adv = compute_advantages(batch, scored["score"], alg, run.kl_ctrl.value, scored["turns"])
            batch.update(advantages=adv["advantages"], returns=adv["returns"])
            run.leave_out_untrained(gens, batch)
        with timer("update_critic"):
            metrics = run.critic.call("update_critic", batch, run.step)[0] if alg.adv_estimator == "gae" else {}
        if run.step >= cfg.trainer.critic_warmup:
            with timer("update_actor"):
                metrics |= run.actor.call("update_actor", batch, run.step, run.kl_loss_coef)[0]
        reason = run.guard_reason(metrics)
        if reason is not None:
            run.rollback(reason)
            continue
        with timer("sync"):
            run.actor.call("sync_weights")
        metrics |= run.advance_kl(adv, batch)
        run.step += 1
        metrics |= summarize_rollout(gens, scored, batch, adv) | sync_check | sampled | timer
        metrics["step"] = run.step
        run.logger.count(len(gens), float(batch["lengths"].sum()))
        if run.step % cfg.trainer.log_every_steps == 0 or run.step == run.total_steps:
            shown = {k.split("/")[-1]: metrics[k] for k in ("reward/score_mean", "actor/kl") if k in metrics}
            metrics |= run.logger.progress(run.step, "samples", shown)
        if cfg.trainer.eval_every_steps and run.step % cfg.trainer.eval_every_steps == 0:
            metrics |= run.validate(run.step)
        run.record(metrics)
        if cfg.trainer.save_every_steps and run.step % cfg.trainer.save_every_steps == 0:
            run.save()
    return run.history[-1] if run.history else {}


def setup(cfg: PPOConfig) -> PPORun:
    """Ray, worker groups, data, resume: everything :func:`fit` needs."""
    from transformers import AutoTokenizer

    from megatron_rlhf.config.ppo_checks import check_layout, validate_ppo_config
    from megatron_rlhf.data.prompts import load_prompts
    from megatron_rlhf.orchestration.cluster import start_ray
    from megatron_rlhf.rewards.registry import get_reward_fn
    from megatron_rlhf.trainer.ppo_worker import policy_files

    validate_ppo_config(cfg)
    arch, hf_dir = policy_files(cfg.actor.model_path)
    world = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    check_parallel_for_model("actor.parallel", cfg.actor.parallel, arch)
    layout = layout_of(cfg.actor.parallel).resolve(world, arch.shape)
    check_layout(cfg, world, layout.dp)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    need_truth = bool(cfg.reward.fn or cfg.reward.oracle_fn)
    checkers = [get_reward_fn(name) for name in {cfg.reward.fn, cfg.reward.oracle_fn} if name]
    limits = dict(tokenizer=tokenizer, prompt_key=cfg.data.prompt_key,
                  ground_truth_key=cfg.data.ground_truth_key, max_prompt=cfg.data.max_prompt_length,
                  overlong=cfg.data.overlong, need_ground_truth=need_truth,
                  check_truth=lambda truth: [fn("", truth) for fn in checkers])
    train, report = load_prompts(cfg.data.train_files, **limits)
    val = load_prompts(cfg.data.val_files, **limits)[0] if cfg.data.val_files else []
    steps_per_epoch = len(train) // cfg.data.train_batch_size
    if steps_per_epoch == 0:
        raise UserError(f"config: {len(train)} prompts are fewer than data.train_batch_size="
                        f"{cfg.data.train_batch_size}")
    total = steps_per_epoch * cfg.trainer.total_epochs
    total = min(total, cfg.trainer.max_steps) if cfg.trainer.max_steps else total
    stop_ids = _stop_ids(tokenizer, cfg.rollout.stop)
    use_gpu = torch.cuda.is_available()
    separate = cfg.resource_pool.critic == "separate"
    started = start_ray(cfg.ray, world + (cfg.resource_pool.critic_world_size if separate else 0), use_gpu)
    try:
        return _place(cfg, arch, layout, world, use_gpu, started, total, steps_per_epoch, train, val,
                      tokenizer, stop_ids, report)
    except BaseException:
        from megatron_rlhf.orchestration.cluster import stop_ray

        stop_ray(started)
        raise


def _place(cfg, arch, layout, world, use_gpu, started, total, steps_per_epoch, train, val, tokenizer,
           stop_ids, report) -> PPORun:
    """Worker groups on the Ray cluster: actor (+ critic when shared), or a critic group apart."""
    from megatron_rlhf.config.ppo_checks import check_layout, optimizer_steps
    from megatron_rlhf.orchestration.worker_group import WorkerGroup
    from megatron_rlhf.rewards.registry import get_reward_fn
    from megatron_rlhf.trainer.ppo_worker import PPOWorker

    separate = cfg.resource_pool.critic == "separate"
    need_truth = bool(cfg.reward.fn or cfg.reward.oracle_fn)
    updates = optimizer_steps(cfg, total, len(train[:cfg.data.train_batch_size]))
    threads = max(1, (torch.get_num_threads() if not use_gpu else 4) // world)
    actor = WorkerGroup("actor", world, use_gpu, threads)
    roles = ("actor",) if separate else ("actor", "critic")
    actor.build(PPOWorker, cfg, roles, layout, updates)
    critic = actor
    if separate:
        size = cfg.resource_pool.critic_world_size
        par = cfg.critic.parallel or cfg.actor.parallel
        critic_layout = layout_of(par).resolve(size, arch.shape)
        check_layout(cfg, size, critic_layout.dp, generates=False)
        critic = WorkerGroup("critic", size, use_gpu, threads)
        critic.build(PPOWorker, cfg, ("critic",), critic_layout, updates)
    run = PPORun(cfg, actor, critic, tokenizer, train, val, stop_ids,
                 get_reward_fn(cfg.reward.fn) if cfg.reward.fn else None,
                 get_reward_fn(cfg.reward.oracle_fn or cfg.reward.fn) if need_truth else None,
                 total, steps_per_epoch, kl_controller(cfg), ray_started=started)
    run.log(f"prompts: {report}; layout {layout}; {world} worker rank(s)"
            f"{f' + {cfg.resource_pool.critic_world_size} critic rank(s)' if separate else ''}; "
            f"{total} steps of {cfg.data.train_batch_size} prompts x {cfg.rollout.n}")
    return run


def _stop_ids(tokenizer, stops: list[str]) -> list[int]:
    ids = []
    for text in stops:
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(tokens) != 1:
            raise UserError(f"config: rollout.stop entry {text!r} is {len(tokens)} tokens; each stop "
                            "string must be a single token")
        ids += tokens
    return ids


def start(run: PPORun) -> None:
    """Resume (or refuse to overwrite), open the logs, first weight sync, first validation."""
    from megatron_rlhf.monitoring import MetricsLogger

    out, t = run.out, run.cfg.trainer
    out.mkdir(parents=True, exist_ok=True)
    saved = run.checkpoints()
    if t.resume == "disable" and (saved or (out / "metrics.jsonl").is_file()):
        raise UserError(f"{out} already holds a run; with trainer.resume=disable choose an empty "
                        "trainer.output_dir")
    if saved and t.resume == "auto":
        run.restore(saved[-1])
        run.log(f"resumed from step {saved[-1]} ({run.ckpt_root})")
    else:
        run.trim_metrics(-1)  # a killed run that never saved starts over: drop its rows
        run.actor.call("sync_weights")
    run.logger = MetricsLogger(str(out), t.logger, run.total_steps, True, start_step=run.step)
    if run.step == 0 and t.val_before_train and run.val:
        run.record({"step": 0, **run.validate(0)})


def train_ppo(cfg: PPOConfig) -> dict[str, float]:
    from megatron_rlhf.orchestration.cluster import stop_ray

    run = None
    try:
        run = setup(cfg)
        start(run)
        last = fit(run)
        if not run.checkpoints() or run.checkpoints()[-1] != run.step:
            run.save()  # before the final validation: a failure there loses no training
        if run.val and not (cfg.trainer.eval_every_steps and run.step % cfg.trainer.eval_every_steps == 0):
            last = {**last, **run.validate(run.step)}
            run.record({"step": run.step, **{k: v for k, v in last.items() if k.startswith("val/")}})
        run.log(f"done: {run.step} steps; checkpoints in {run.ckpt_root}")
        return last
    finally:
        if run is not None:
            if run.logger is not None:
                run.logger.close()
            for group in {id(run.actor): run.actor, id(run.critic): run.critic}.values():
                group.shutdown()
            stop_ray(run.ray_started)
