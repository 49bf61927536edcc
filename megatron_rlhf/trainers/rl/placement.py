"""Set-up of an RL run: every agent's config, model, layout and batch checked, then Ray started
and the worker groups placed.

A plain run (``actor.*`` alone) is one agent named ``actor`` over all the job's ranks. With
``agents:`` each agent gets a group of its own on a resource pool it shares with other agents
or has alone; its critic (GAE) and, unless a judge serves it, its reward model sit in its own
group (or, for one agent with ``resource_pool.critic=separate``, in a critic group apart). A
judge group hosts a reward model shared by several agents that need no critic.
"""

from __future__ import annotations

import torch

from megatron_rlhf.config.ppo_schema import AgentConfig, PPOConfig
from megatron_rlhf.errors import UserError
from megatron_rlhf.trainers.rl.worker import PPOWorker
from megatron_rlhf.trainers.rl.run import RLRun, check_inputs


def agent_specs(cfg: PPOConfig) -> list[AgentConfig]:
    """``agents``, or the one agent a plain run is: ``actor.*`` over every rank of the job."""
    if cfg.agents:
        return list(cfg.agents)
    return [AgentConfig(name="actor", model_path=cfg.actor.model_path,
                        world_size=cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes)]


def agent_configs(cfg: PPOConfig) -> dict[str, PPOConfig]:
    """Each agent's own PPO config (a plain run's is ``cfg`` itself), validated."""
    from megatron_rlhf.config.agents import agent_config
    from megatron_rlhf.config.ppo_checks import validate_ppo_config

    if not cfg.agents:
        return {"actor": cfg}
    out = {a.name: agent_config(cfg, a, i) for i, a in enumerate(cfg.agents)}
    for name, c in out.items():
        try:
            validate_ppo_config(c)
        except UserError as err:
            raise UserError(f"agent {name}: {err}") from None
    return out


def setup(cfg: PPOConfig) -> RLRun:
    """Validate, load the data, check every agent, start Ray, place the groups."""
    from megatron_rlhf.config.agents import check_agents, judges, pools
    from megatron_rlhf.config.ppo_checks import validate_ppo_config
    from megatron_rlhf.trainers.rl.modes import make_mode
    from megatron_rlhf.orchestration.cluster import start_ray, stop_ray
    from megatron_rlhf.rollout.tool_turns import make_tool_env
    from megatron_rlhf.trainers.rl.data import reward_scorer, setup_data

    if cfg.agents:
        check_agents(cfg)  # first: an agent list that makes no sense says so before the rest
    validate_ppo_config(cfg)
    check_inputs(cfg)
    specs, configs = agent_specs(cfg), agent_configs(cfg)
    rewards = reward_scorer(cfg)
    data = setup_data(configs[specs[0].name], rewards)
    mode = make_mode(cfg, [a.name for a in specs])
    run = RLRun(cfg, {}, mode, data.total, rewards=rewards)
    layouts = {a.name: _check_agent(run, configs[a.name], a, data) for a in specs}
    _check_judges(cfg, data)
    offline = {a.name: _offline(configs[a.name], data.tokenizer, rewards.needs_ground_truth())
               for a in specs}
    use_gpu = torch.cuda.is_available()
    sizes = {pool: max(a.world_size for a in members) for pool, members in pools(specs).items()}
    judge = cfg.multi_agent.judge_world_size * len(judges(cfg))
    apart = cfg.resource_pool.critic_world_size if cfg.resource_pool.critic == "separate" else 0
    apart += sum(c.rollout.world_size for c in configs.values() if c.rollout.placement == "separate")
    run.ray_started = start_ray(cfg.ray, sum(sizes.values()) + judge + apart, use_gpu)
    try:
        rewards.start()  # the reward pool: once per run
        run.tools = make_tool_env(cfg.rollout, data.tokenizer)  # workers, sandbox probe
        threads = max(1, (torch.get_num_threads() if not use_gpu else 4) // (sum(sizes.values()) + judge))
        _place_judges(run, configs, data, use_gpu, threads)
        _place_agents(run, specs, configs, layouts, sizes, data, use_gpu, threads)
        for name, groups in offline.items():
            run.agents[name].offline = groups
        _log_placement(run, data, layouts)
        return run
    except BaseException:
        shutdown(run)  # whatever was placed: reward pool, judges, agent groups, pools
        stop_ray(run.ray_started)
        raise


def _check_agent(run: RLRun, c: PPOConfig, agent: AgentConfig, data):
    """One agent's model, vocabulary, layout and batch arithmetic, before anything is placed;
    returns its layout."""
    from megatron_rlhf.config.loader import batch_plan
    from megatron_rlhf.config.parallel import check_parallel_for_model, layout_of
    from megatron_rlhf.config.ppo_checks import check_layout, critic_parallel
    from megatron_rlhf.trainers.rl.policy import policy_files

    key, arch = "actor.parallel", data.arch
    if not run.single:
        key = f"agents.{agent.name}.parallel"
        arch, hf_dir = policy_files(agent.model_path)
        _same_vocabulary(data.tokenizer, hf_dir, f"agent {agent.name}")
        if c.actor.ref_model_path:
            _same_vocabulary(data.tokenizer, policy_files(c.actor.ref_model_path)[1],
                             f"agent {agent.name}'s reference")
    check_parallel_for_model(key, c.actor.parallel, arch)
    layout = layout_of(c.actor.parallel).resolve(agent.world_size, arch.shape)
    try:
        check_layout(c, agent.world_size, layout.dp)
        # What the update's plan divides: the step's samples when fewer than a mini-batch.
        batch_plan(min(c.actor.ppo_mini_batch_size, _samples_per_step(c, agent.name, run.mode)),
                   c.actor.ppo_micro_batch_size_per_rank, layout.dp)
        if c.resource_pool.critic == "separate":
            size = c.resource_pool.critic_world_size
            check_layout(c, size, layout_of(critic_parallel(c)).resolve(size, arch.shape).dp,
                         generates=False)
    except UserError as err:
        if run.single:
            raise
        raise UserError(f"agent {agent.name}: {err}") from None
    return layout


def _check_judges(cfg: PPOConfig, data) -> None:
    """Each judge's reward model: loadable at the judges' layout, the agents' vocabulary."""
    from megatron_rlhf.config.agents import judges
    from megatron_rlhf.trainers.rl.value_init import reward_model_source

    for path, names in judges(cfg).items():
        what = f"the reward model of agent(s) {', '.join(names)}"
        source = reward_model_source(path, _judge_layout(cfg, data), what)
        _same_vocabulary(data.tokenizer, source.hf_dir, what)


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


def _place_agents(run: RLRun, specs, configs, layouts, sizes, data, use_gpu, threads) -> None:
    """Each agent's group on its pool (shared pools: each rank a fraction of a device), its
    critic in it or apart, its judge if one serves it."""
    from megatron_rlhf.config.agents import pools
    from megatron_rlhf.orchestration.worker_group import ResourcePool, WorkerGroup
    from megatron_rlhf.trainers.rl.agent import PPORun, kl_controller

    for pool_name, members in pools(specs).items():
        pool = None  # a group alone on its devices makes its own
        if len(members) > 1:
            pool = ResourcePool(pool_name, sizes[pool_name], use_gpu)
            run.pools.append(pool)
        for spec in members:
            c = configs[spec.name]
            spans = c.rollout.backend == "sglang" and c.rollout.tp > 1
            group = WorkerGroup("actor" if run.single else f"agent-{spec.name}", spec.world_size,
                                use_gpu, threads, pool=pool, share=len(members),
                                node_gpus=use_gpu and spans)
            judge = run.judges.get(c.reward.model_path) if c.reward.model_path else None
            apart = c.resource_pool.critic == "separate"
            agent = PPORun(c, group, judge or group, data.tokenizer, data.train, data.val,
                           data.stop_ids, run.rewards.fns.get("fn"), run.rewards.fns.get("oracle"),
                           data.total, data.steps_per_epoch, kl_controller(c), rewards=run.rewards,
                           label="ppo" if run.single else f"agent {spec.name}",
                           judged=judge is not None, tools=run.tools)
            run.agents[spec.name] = agent
            updates = _updates(c, spec.name, run.mode, data.total)
            group.build(PPOWorker, c, ("actor",) if judge or apart else ("actor", "critic"),
                        layouts[spec.name], updates)
            if apart:
                agent.critic = _critic_apart(c, data, use_gpu, threads, updates)
            if c.rollout.placement == "separate":
                agent.rollout_group = _rollout_apart(c, group, use_gpu, threads)
            if len(members) > 1:  # the next agent's engine starts on the same device
                group.call(PPOWorker.release_rollout)
            if not run.single:
                run.log(f"agent {spec.name}: {spec.model_path}, layout {layouts[spec.name]} on pool "
                        f"{pool_name} ({len(members)} agent(s) sharing {sizes[pool_name]} device(s))")
    run.agents = {a.name: run.agents[a.name] for a in specs}  # the config's order


def _rollout_apart(c: PPOConfig, actor, use_gpu: bool, threads: int):
    """The separate rollout group: engines of ``rollout.tp`` over ``rollout.world_size`` ranks of
    their own, and the weight bridge from the actor group's rank 0 to every one of them."""
    from megatron_rlhf.orchestration.worker_group import WorkerGroup, call_together
    from megatron_rlhf.trainers.rl.rollout_worker import RolloutWorker

    size = c.rollout.world_size
    group = WorkerGroup("rollout", size, use_gpu, threads,
                        node_gpus=use_gpu and c.rollout.backend == "sglang" and c.rollout.tp > 1)
    group.build(RolloutWorker, c.rollout, actor.call(PPOWorker.rollout_spec)[0])
    host, port = actor.address()
    call_together((actor, PPOWorker.open_bridge, host, port, size + 1),
                  (group, RolloutWorker.open_bridge, host, port, size + 1))
    return group


def _critic_apart(c: PPOConfig, data, use_gpu: bool, threads: int, updates: dict):
    from megatron_rlhf.config.parallel import layout_of
    from megatron_rlhf.config.ppo_checks import critic_parallel
    from megatron_rlhf.orchestration.worker_group import WorkerGroup

    size = c.resource_pool.critic_world_size
    group = WorkerGroup("critic", size, use_gpu, threads)
    group.build(PPOWorker, c, ("critic",), layout_of(critic_parallel(c)).resolve(size, data.arch.shape),
                updates)
    return group


def _place_judges(run: RLRun, configs: dict, data, use_gpu: bool, threads: int) -> None:
    """A judge group per distinct reward model, built from the config of its first agent."""
    from megatron_rlhf.config.agents import judges
    from megatron_rlhf.orchestration.worker_group import WorkerGroup

    cfg, size = run.cfg, run.cfg.multi_agent.judge_world_size
    for k, (path, names) in enumerate(judges(cfg).items()):
        group = WorkerGroup("judge" if k == 0 else f"judge-{k}", size, use_gpu, threads)
        run.judges[path] = group
        group.build(PPOWorker, configs[names[0]], ("critic",), _judge_layout(cfg, data),
                    {"actor": 0, "critic": 0})
        run.log(f"judge {k}: reward model {path} on {size} rank(s), scoring agent(s) "
                f"{', '.join(names)}")


def _judge_layout(cfg: PPOConfig, data):
    """Every judge group's layout: ``critic.parallel`` (else ``actor.parallel``) over
    ``multi_agent.judge_world_size`` ranks."""
    from megatron_rlhf.config.parallel import layout_of
    from megatron_rlhf.config.ppo_checks import critic_parallel

    return layout_of(critic_parallel(cfg)).resolve(cfg.multi_agent.judge_world_size, data.arch.shape)


def _log_placement(run: RLRun, data, layouts: dict) -> None:
    cfg = run.cfg
    if run.single:
        agent = next(iter(run.agents.values()))
        apart = agent.critic is not agent.actor
        where = f" + {agent.critic.world_size} critic rank(s)" if apart else ""
        run.log(f"prompts: {data.report}; layout {next(iter(layouts.values()))}; "
                f"{agent.actor.world_size} worker rank(s){where}; {data.total} steps of "
                f"{cfg.data.train_batch_size} prompts x {cfg.rollout.n}")
    else:
        run.log(f"mode {cfg.multi_agent.mode}; {data.total} steps of {cfg.data.train_batch_size} "
                f"prompts; prompts: {data.report}")
    rewards = run.rewards
    if rewards.fns:
        where = (f"{rewards.workers} worker process(es), {rewards.timeout_s:g} s per call"
                 if rewards.pool is not None else "in the driver process, no timeout")
        run.log(f"reward functions: {', '.join(sorted({f.spec for f in rewards.fns.values()}))} "
                f"({where})")


def _updates(c: PPOConfig, name: str, mode, total: int) -> dict[str, int]:
    """The agent's LR-schedule lengths (actor, and critic)."""
    from megatron_rlhf.config.ppo_checks import optimizer_steps

    return optimizer_steps(c, total, _samples_per_step(c, name, mode))


def _samples_per_step(c: PPOConfig, name: str, mode) -> int:
    """A proposer writes one sample per task; every other agent ``rollout.n`` per prompt."""
    if getattr(mode, "proposer", None) == name:
        return c.data.train_batch_size
    return c.data.train_batch_size * c.rollout.n


def _same_vocabulary(tokenizer, hf_dir, what: str) -> None:
    """Agents pass token ids to each other and to one reward model: one vocabulary for all."""
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise UserError(f"{what}: its tokenizer ({hf_dir}) differs from the first agent's; "
                        "agents exchange token ids and share a reward model, so they need one "
                        "vocabulary")


def shutdown(run: RLRun) -> None:
    """Close whatever exists (a failed set-up leaves part of it)."""
    if run.rewards is not None:
        run.rewards.close()
    for agent in run.agents.values():
        if agent.ahead_thread is not None:
            agent.ahead_thread.shutdown(wait=True)
    if run.tools is not None:
        run.tools.close()
    if run.logger is not None:
        run.logger.close()
    for group in run.groups() + [a.rollout_group for a in run.agents.values() if a.rollout_group]:
        group.shutdown()
    for pool in run.pools:
        pool.remove()
