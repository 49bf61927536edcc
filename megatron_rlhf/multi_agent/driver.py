"""Several actors trained together: ``megatron-rlhf ppo`` with an ``agents:`` list.

Each agent is a :class:`~megatron_rlhf.trainer.ppo_driver.PPORun` of its own: its model,
optimizer, layout, rollout engine and weight sync live in its own worker group, on a resource
pool it shares with other agents or has alone. A reward model lives in a judge group that
scores the samples of every agent using it: one for all (``reward.model_path``), or one per
distinct ``agents[i].reward_model_path``. The play mode
(:mod:`megatron_rlhf.multi_agent.modes`) decides who speaks and what each agent is scored on;
the loop is PPO's, once per agent: play -> experience -> advantages -> update -> sync weights.
Checkpoints are per agent, and a step counts as saved only when every agent has it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_rlhf.config.ppo_schema import PPOConfig
from megatron_rlhf.errors import UserError
from megatron_rlhf.trainer.ppo_driver import Timer, close_step, rollback_target, summarize_rollout
from megatron_rlhf.trainer.ppo_experience import compute_advantages
from megatron_rlhf.trainer.rl_run import RLRunState, check_inputs
from megatron_rlhf.trainer.ppo_worker import PPOWorker


@dataclass
class MultiAgentRun(RLRunState):
    cfg: PPOConfig
    agents: dict  # name -> PPORun (insertion order: the config's)
    mode: object  # PlayMode
    total_steps: int
    judges: dict = field(default_factory=dict)  # reward model path -> WorkerGroup hosting it
    pools: list = field(default_factory=list)
    rewards: object = None  # the shared RewardScorer
    ray_started: bool = False
    step: int = 0
    logger: object = None
    history: list[dict] = field(default_factory=list)
    stop: object = None  # StopRequest: stop signals and trainer.stop_at (the driver's)
    last_saved: int = -1

    @property
    def out(self) -> Path:
        return Path(self.cfg.trainer.output_dir)

    def log(self, message: str) -> None:
        print(f"[multi-agent] {message}", flush=True)

    # ------------------------------------------------------------------ one step
    def update(self, name: str, episode, step: int, timer) -> tuple[dict, list[str], dict]:
        """Experience, advantages and the update of one agent: (its metrics, the preference
        table digests its ranks reported, its advantages)."""
        agent, batch = self.agents[name], episode.batch
        with timer(f"old_log_prob/{name}"):
            metrics = agent.log_probs(batch, episode.gens)
        adv = compute_advantages(batch, episode.scored["score"], agent.cfg.algorithm,
                                 agent.kl_ctrl.value, episode.scored.get("turns"))
        if episode.advantages is not None:  # population: the workers derive them from the table
            adv.update(advantages=episode.advantages, returns=episode.advantages)
        else:
            batch.update(advantages=adv["advantages"], returns=adv["returns"])
        agent.leave_out_untrained(episode.gens, batch)
        with timer(f"update/{name}"):
            ranks = agent.actor.call(PPOWorker.update_actor, {**batch, **episode.population}, step,
                                     agent.kl_loss_coef)
        digests = [r.pop("population/table_sha256") for r in ranks if "population/table_sha256" in r]
        metrics |= ranks[0] | episode.metrics
        metrics |= summarize_rollout(episode.gens, episode.scored, batch, adv)
        return metrics, digests, adv

    def validate(self, step: int) -> dict[str, float]:
        out = {}
        for name in self.mode.validated(self):
            out |= {f"agent/{name}/{k}": v for k, v in self.agents[name].validate(step).items()}
        return out

    # ------------------------------------------------------------------ checkpoints
    def checkpoints(self) -> list[int]:
        """Steps every agent has a checkpoint of, oldest first."""
        steps = [set(agent.checkpoints()) for agent in self.agents.values()]
        return sorted(set.intersection(*steps))

    def saving_groups(self) -> list[tuple]:
        """Every agent's group with its trainer state (the step in each agent's
        trainer_state.json); a kill between two agents' saves leaves the previous common step
        intact (the lone newer one goes at the next prune)."""
        out = []
        for agent in self.agents.values():
            agent.step = self.step
            out.append((agent.actor, agent.ckpt_root, agent.state()))
        return out

    def stop_groups(self) -> list:
        return [a.actor for a in self.agents.values()] + list(self.judges.values())

    def checkpoint_folders(self, step: int) -> list:
        return [f for agent in self.agents.values() for f in agent.checkpoint_folders(step)]

    def prune_saved(self) -> None:
        keep = set(self.checkpoints()[-self.cfg.trainer.keep_last_n:])
        for agent in self.agents.values():
            agent.prune(keep)

    def restore(self, step: int, keep_scales: bool = False) -> list[dict]:
        """Every agent back to ``step``; returns the metrics rows its checkpoint had seen."""
        states = [agent.restore(step, keep_scales) for agent in self.agents.values()]
        self.step = self.last_saved = step
        return self.trim_metrics(step, (states[0] or {}).get("metrics_rows"))

    def rollback(self, name: str, reason: str) -> None:
        """Every agent back to the newest common checkpoint, with the lowered learning rates
        and raised KL weights of ``trainer.rollback``."""
        failed, first = self.step + 1, next(iter(self.agents.values()))
        if self.cfg.trainer.async_save:
            self.collect_saves(blocking=True)  # a save in flight is of a good step
        target = rollback_target(failed, f"agent {name}: {reason}", self.checkpoints(),
                                 first.rollbacks, self.cfg.trainer.rollback, self.out / "agents")
        for agent in self.agents.values():
            agent.lower_rates()
        self.restore(target, keep_scales=True)
        self.log(f"rollback {first.rollbacks}/{self.cfg.trainer.rollback.max_rollbacks} at step "
                 f"{failed}: agent {name}: {reason}; every agent restored to step {target}")


def fit(run: MultiAgentRun) -> dict[str, float]:
    """The multi-agent loop: each step the mode plays, then every playing agent updates."""
    while run.step < run.total_steps:
        timer = Timer()
        with timer("play"):
            episodes, metrics = run.mode.play(run, run.step, timer)
        metrics |= next(iter(run.agents.values())).reward_metrics()  # the scorer is shared
        digests, bad, advantages = [], None, {}
        for name, episode in episodes.items():
            mine, seen, advantages[name] = run.update(name, episode, run.step, timer)
            digests += seen
            metrics |= {f"agent/{name}/{k}": v for k, v in mine.items()}
            reason = run.agents[name].guard_reason(mine)
            bad = bad or (reason and (name, reason))
        if len(set(digests)) > 1:
            raise UserError(f"step {run.step + 1}: the agents' workers received different "
                            "preference tables; stopped (checkpoints untouched)")
        if digests:
            metrics["population/table_ranks_agreeing"] = float(len(digests))
        if bad:
            run.rollback(*bad)
            continue
        with timer("sync"):
            for name, episode in episodes.items():
                run.agents[name].actor.call(PPOWorker.sync_weights)
                kl = run.agents[name].advance_kl(advantages[name], episode.batch)  # accepted steps only
                metrics |= {f"agent/{name}/{k}": v for k, v in kl.items()}
        run.step += 1
        metrics |= dict(timer)
        shown = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.endswith("/reward/score_mean")}
        close_step(run, metrics, sum(len(e.gens) for e in episodes.values()),
                   float(sum(e.batch["lengths"].sum() for e in episodes.values())), shown)
    return run.history[-1] if run.history else {}


# ---------------------------------------------------------------------- set-up and teardown
def setup(cfg: PPOConfig) -> MultiAgentRun:
    """Validate, start Ray, place every agent's group (and the judge), load the data."""
    from megatron_rlhf.config.ppo_checks import validate_ppo_config
    from megatron_rlhf.config.agents import agent_config, check_agents
    from megatron_rlhf.orchestration.cluster import start_ray, stop_ray

    check_agents(cfg)  # first: an agent list that makes no sense says so before the rest
    validate_ppo_config(cfg)
    check_inputs(cfg)
    configs = {a.name: agent_config(cfg, a, i) for i, a in enumerate(cfg.agents)}
    for name, c in configs.items():
        try:
            validate_ppo_config(c)
        except UserError as err:
            raise UserError(f"agent {name}: {err}") from None
    from megatron_rlhf.config.agents import judges, pools

    use_gpu = torch.cuda.is_available()
    sizes = {pool: max(a.world_size for a in members) for pool, members in pools(cfg).items()}
    judge = cfg.multi_agent.judge_world_size * len(judges(cfg))
    started = start_ray(cfg.ray, sum(sizes.values()) + judge, use_gpu)
    run = MultiAgentRun(cfg, {}, None, 0, ray_started=started)
    try:
        _place(run, configs, sizes, use_gpu)
        return run
    except BaseException:
        shutdown(run)  # whatever was placed: reward pool, judges, agent groups, pools
        stop_ray(started)
        raise


def _place(run: MultiAgentRun, configs: dict, sizes: dict, use_gpu: bool) -> None:
    """Every agent checked first (model, vocabulary, layout), then the judges and the agents'
    groups placed on their pools."""
    from megatron_rlhf.config.agents import judges, pools, reward_model
    from megatron_rlhf.multi_agent.modes import make_mode
    from megatron_rlhf.orchestration.worker_group import ResourcePool, WorkerGroup
    from megatron_rlhf.trainer.run_data import reward_scorer, setup_data
    from megatron_rlhf.trainer.ppo_driver import PPORun, kl_controller
    from megatron_rlhf.trainer.value_init import reward_model_source

    cfg = run.cfg
    run.rewards = reward_scorer(cfg)
    first = configs[cfg.agents[0].name]
    data = setup_data(first, run.rewards)
    run.mode, run.total_steps = make_mode(cfg, list(configs)), data.total
    layouts = {a.name: _check_agent(configs[a.name], a, data, run.mode) for a in cfg.agents}
    for path, names in judges(cfg).items():  # once per reward model, before anything is placed
        what = f"the reward model of agent(s) {', '.join(names)}"
        source = reward_model_source(path, _judge_layout(cfg, data), what)
        _same_vocabulary(data.tokenizer, source.hf_dir, what)
    run.rewards.start()
    ranks = sum(sizes.values()) + cfg.multi_agent.judge_world_size * len(judges(cfg))
    threads = max(1, (torch.get_num_threads() if not use_gpu else 4) // ranks)
    _place_judges(run, configs, data, use_gpu, threads)
    for pool_name, members in pools(cfg).items():
        pool = ResourcePool(pool_name, sizes[pool_name], use_gpu)
        run.pools.append(pool)
        for agent in members:
            c = configs[agent.name]
            group = WorkerGroup(f"agent-{agent.name}", agent.world_size, use_gpu, threads,
                                pool=pool, share=len(members))
            judge = run.judges.get(reward_model(cfg, agent), group)
            run.agents[agent.name] = PPORun(
                c, group, judge, data.tokenizer, data.train, data.val, data.stop_ids,
                run.rewards.fns.get("fn"), run.rewards.fns.get("oracle"), data.total,
                data.steps_per_epoch, kl_controller(c), rewards=run.rewards,
                label=f"agent {agent.name}")
            group.build(PPOWorker, c, ("actor",), layouts[agent.name],
                        _updates(c, agent.name, run.mode, data.total))
            if len(members) > 1:  # the next agent's engine starts on the same device
                group.call(PPOWorker.release_rollout)
            run.log(f"agent {agent.name}: {agent.model_path}, layout {layouts[agent.name]} on pool "
                    f"{pool_name} ({len(members)} agent(s) sharing {pool.size} device(s))")
    run.agents = {a.name: run.agents[a.name] for a in cfg.agents}  # the config's order
    run.log(f"mode {cfg.multi_agent.mode}; {data.total} steps of {cfg.data.train_batch_size} "
            f"prompts; prompts: {data.report}")


def _place_judges(run: MultiAgentRun, configs: dict, data, use_gpu: bool, threads: int) -> None:
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


def _check_agent(c: PPOConfig, agent, data, mode):
    """One agent's model, vocabulary, layout and batch arithmetic, before anything is placed;
    returns its layout."""
    from megatron_rlhf.config.loader import batch_plan
    from megatron_rlhf.config.parallel import check_parallel_for_model, layout_of
    from megatron_rlhf.config.ppo_checks import check_layout
    from megatron_rlhf.trainer.ppo_worker import policy_files

    arch, hf_dir = policy_files(agent.model_path)
    _same_vocabulary(data.tokenizer, hf_dir, f"agent {agent.name}")
    if c.actor.ref_model_path:
        _same_vocabulary(data.tokenizer, policy_files(c.actor.ref_model_path)[1],
                         f"agent {agent.name}'s reference")
    check_parallel_for_model(f"agents.{agent.name}.parallel", c.actor.parallel, arch)
    layout = layout_of(c.actor.parallel).resolve(agent.world_size, arch.shape)
    try:
        check_layout(c, agent.world_size, layout.dp)
        # What the update's plan divides: the step's samples when fewer than a mini-batch.
        batch_plan(min(c.actor.ppo_mini_batch_size, _samples_per_step(c, agent.name, mode)),
                   c.actor.ppo_micro_batch_size_per_rank, layout.dp)
    except UserError as err:
        raise UserError(f"agent {agent.name}: {err}") from None
    return layout


def _updates(c: PPOConfig, name: str, mode, total: int) -> dict[str, int]:
    """The agent's LR-schedule length (no critic in a multi-agent run)."""
    from megatron_rlhf.config.ppo_checks import optimizer_steps

    return optimizer_steps(c, total, _samples_per_step(c, name, mode), critic=False)


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


def start(run: MultiAgentRun) -> None:
    """Resume from the newest step every agent has (or refuse to overwrite), open the logs,
    first weight sync, first validation."""
    from megatron_rlhf.monitoring import MetricsLogger

    from megatron_rlhf.checkpoint.train_ckpt import remove_unfinished

    out, t = run.out, run.cfg.trainer
    out.mkdir(parents=True, exist_ok=True)
    for agent in run.agents.values():
        remove_unfinished(agent.ckpt_root / "actor")
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
        run.log(f"resumed every agent from step {saved[-1]} ({out / 'agents'})")
    else:
        run.trim_metrics(-1, rows=0)
        for agent in run.agents.values():
            agent.actor.call(PPOWorker.sync_weights)
    run.logger = MetricsLogger(str(out), t.logger, run.total_steps, True, start_step=run.step,
                               kept=kept)
    if run.step == 0 and t.val_before_train and next(iter(run.agents.values())).val:
        run.record({"step": 0, **run.validate(0)})


def shutdown(run: MultiAgentRun) -> None:
    """Close whatever exists (a failed set-up leaves part of it)."""
    if run.rewards is not None:
        run.rewards.close()
    if run.logger is not None:
        run.logger.close()
    for agent in run.agents.values():
        agent.actor.shutdown()
    for judge in run.judges.values():
        judge.shutdown()
    for pool in run.pools:
        pool.remove()


def train_agents(cfg: PPOConfig) -> dict[str, float]:
    """``megatron-rlhf ppo`` with ``agents:``: set up, resume, train, save, validate."""
    from megatron_rlhf.orchestration.cluster import stop_ray
    from megatron_rlhf.trainer.lifecycle import StopRequest
    from megatron_rlhf.trainer.loop import already_finished
    from megatron_rlhf.trainer.rl_run import finish

    if already_finished("multi-agent", cfg):
        return {}
    stop = StopRequest(cfg.trainer, "multi-agent").install()  # before the long set-up
    run = None
    try:
        run = setup(cfg)
        run.stop = stop.install()  # again: Ray's init took SIGTERM
        start(run)
        fit(run)
        last = finish(run)
        run.log(f"done: {run.step} steps; checkpoints in {run.out / 'agents'}/<name>/checkpoints")
        return last
    finally:
        if run is not None:
            shutdown(run)
            stop_ray(run.ray_started)
        stop.uninstall()
