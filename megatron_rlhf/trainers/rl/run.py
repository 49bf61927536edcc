"""The state of an RL run, one agent or many: logs, checkpoints, rollbacks and stops.

A run keeps ``metrics.jsonl`` (one row per step; a resume cuts it back to the rows its checkpoint
had seen), saves every agent's models at step boundaries (committed at once, or later when
``trainer.async_save``), counts a step as saved only when every agent has it, prunes only what
every model has committed, and stops cleanly on a signal (to the driver, or to any worker) or
``trainer.stop_at``. A run of one agent (``actor.*`` alone, or ``agents:`` of one with no
``multi_agent.mode``) names its metrics, checkpoints and log lines as plain PPO always has; with
several, each agent's metrics are under ``agent/<name>/`` and its checkpoints under
``agents/<name>/``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rlhf.config.ppo_checks import uses_critic
from megatron_rlhf.config.ppo_schema import PPOConfig
from megatron_rlhf.errors import RunStopped, UserError
from megatron_rlhf.trainers.lifecycle import MetricsFile, mark_finished
from megatron_rlhf.trainers.rl.agent import rollback_target, summarize_rollout
from megatron_rlhf.trainers.rl.ahead import dump_rollouts
from megatron_rlhf.trainers.rl.experience import check_experience, compute_advantages
from megatron_rlhf.trainers.rl.residency import offloads, reduce_stats
from megatron_rlhf.trainers.rl.worker import PPOWorker


@dataclass
class Update:
    """What one agent's update of a step returns to the loop."""

    metrics: dict[str, float]  # the agent's step metrics, unprefixed
    trained: dict[str, float]  # the critic's and actor's own (what the guard inspects)
    advantages: dict  # compute_advantages' output (advantages, returns, kl)
    digests: list[str]  # population: the preference-table digest each rank reported


@dataclass
class RLRun:
    cfg: PPOConfig
    agents: dict  # name -> PPORun, in the config's order
    mode: object  # PlayMode
    total_steps: int
    judges: dict = field(default_factory=dict)  # reward model path -> WorkerGroup hosting it
    pools: list = field(default_factory=list)
    rewards: object = None  # the RewardScorer every agent shares
    tools: object = None  # rollout.tools' ToolEnv every agent shares (None: no tools)
    ray_started: bool = False
    step: int = 0
    logger: object = None
    history: list[dict] = field(default_factory=list)
    stop: object = None  # StopRequest: stop signals and trainer.stop_at (the driver's)
    last_saved: int = -1
    failed: tuple = (-1, 0)  # (step the guard last rejected, how many times in a row)

    @property
    def single(self) -> bool:
        """One agent: plain PPO's names for metrics, checkpoints and log lines."""
        return len(self.cfg.agents) <= 1

    @property
    def out(self) -> Path:
        return Path(self.cfg.trainer.output_dir)

    @property
    def label(self) -> str:
        return "ppo" if self.single else "multi-agent"

    def log(self, message: str) -> None:
        print(f"[{self.label}] {message}", flush=True)

    def named(self, name: str, metrics: dict[str, float]) -> dict[str, float]:
        return metrics if self.single else {f"agent/{name}/{k}": v for k, v in metrics.items()}

    def phase(self, what: str, name: str) -> str:
        return what if self.single else f"{what}/{name}"

    def shown(self, metrics: dict[str, float]) -> dict[str, float]:
        """The progress line's figures."""
        if self.single:
            return {k.split("/")[-1]: metrics[k] for k in ("reward/score_mean", "actor/kl") if k in metrics}
        return {k.split("/", 1)[1]: v for k, v in metrics.items() if k.endswith("/reward/score_mean")}

    def reward_metrics(self) -> dict[str, float]:
        return next(iter(self.agents.values())).reward_metrics()  # the scorer is shared

    # ------------------------------------------------------------------ one agent's update
    def update(self, name: str, episode, timer) -> Update:
        """Experience, advantages and the updates of one agent (critic, then actor)."""
        agent, batch, step = self.agents[name], episode.batch, self.step
        started = time.time()
        if agent.cfg.rollout.max_staleness:
            agent.start_ahead(step)  # the next steps' generation overlaps this update
        with timer(self.phase("old_ref_log_prob", name)):
            metrics = agent.log_probs(batch, episode.gens)
        with timer(self.phase("adv", name)):
            agent.fill_values(batch)  # a mode's batch the critic has not seen yet
            adv = compute_advantages(batch, episode.scored["score"], agent.cfg.algorithm,
                                     agent.kl_ctrl.value, episode.scored.get("turns"))
            if episode.advantages is not None:  # population: the workers derive them from the table
                adv.update(advantages=episode.advantages, returns=episode.advantages)
            else:
                batch.update(advantages=adv["advantages"], returns=adv["returns"])
            agent.leave_out_untrained(episode.gens, batch)
        check_experience({**batch, **episode.population}, f"step {step + 1}, agent {name}")
        trained, digests = {}, []
        with timer(self.phase("update_critic", name)):
            if uses_critic(agent.cfg):
                trained = agent.critic.call(PPOWorker.update_critic, batch, step)[0]
        if step >= agent.cfg.trainer.critic_warmup:
            with timer(self.phase("update_actor", name)):
                ranks = agent.actor.call(PPOWorker.update_actor, {**batch, **episode.population},
                                         step, agent.kl_loss_coef)
            digests = [r.pop("population/table_sha256") for r in ranks if "population/table_sha256" in r]
            trained |= ranks[0]
        metrics |= trained | episode.metrics | summarize_rollout(episode.gens, episode.scored, batch, adv)
        if offloads(agent.cfg):  # the moves since the last report, the busiest rank's
            metrics |= reduce_stats([r for g in agent.groups() for r in g.call(PPOWorker.offload_stats)])
        agent.update_spans = {step: (started, time.time())}  # what generation ahead overlapped
        if agent.cfg.trainer.rollout_data_dir:
            folder = agent.out / agent.cfg.trainer.rollout_data_dir
            age = int(episode.metrics.get("rollout/staleness", 0))
            dump_rollouts(folder, step, episode, step - age)
        return Update(metrics, trained, adv, digests)

    def check_tables(self, updates: dict[str, Update], metrics: dict) -> None:
        """Population: every rank of every agent trained on the driver's one table."""
        digests = [d for u in updates.values() for d in u.digests]
        if len(set(digests)) > 1:
            raise UserError(f"step {self.step + 1}: the agents' workers received different "
                            "preference tables; stopped (checkpoints untouched)")
        if digests:
            metrics["population/table_ranks_agreeing"] = float(len(digests))

    def guard(self, updates: dict[str, Update]) -> tuple[str, str] | None:
        """(agent, why) for the first agent whose update must be undone, or None."""
        for name, u in updates.items():
            reason = self.agents[name].guard_reason(u.trained)
            if reason is not None:
                return name, reason
        return None

    def validate(self, step: int) -> dict[str, float]:
        out = {}
        for name in self.mode.validated(self):
            out |= self.named(name, self.agents[name].validate(step))
        return out

    # ------------------------------------------------------------------ metrics
    @property
    def metrics(self) -> MetricsFile:
        return MetricsFile(self.out / "metrics.jsonl")

    def record(self, metrics: dict[str, float]) -> None:
        self.history.append(metrics)
        if self.logger is not None:
            self.logger.scalars(metrics["step"], {k: v for k, v in metrics.items() if k != "step"})
        self.metrics.append(metrics)

    def trim_metrics(self, step: int, rows: int | None = None) -> list[dict]:
        """Back to what a checkpoint of ``step`` had seen (``rows``: its row count; else the
        rows up to ``step``); returns the kept rows. Hides later TensorBoard points."""
        kept = self.metrics.trim(step, rows) if self.metrics.exists() else []
        if self.logger is not None:
            self.logger.rewind(step)
        self.history = [h for h in self.history if h["step"] <= step]
        return kept

    # ------------------------------------------------------------------ checkpoints
    def groups(self) -> list:
        """Every worker group, each once: agents' (and their critics'), then the judges."""
        found = [g for agent in self.agents.values() for g in agent.groups()] + list(self.judges.values())
        return list({id(g): g for g in found}.values())

    def checkpoints(self) -> list[int]:
        """Steps every agent has a checkpoint of (every model of each), oldest first."""
        steps = [set(agent.checkpoints()) for agent in self.agents.values()]
        return sorted(set.intersection(*steps))

    def saving_groups(self) -> list[tuple]:
        """(group, checkpoint root, trainer state) of every agent's models. A kill between two
        agents' saves leaves the previous common step intact (the lone newer one goes at the
        next prune)."""
        out = []
        for agent in self.agents.values():
            agent.step = self.step
            out += [(group, agent.ckpt_root, agent.state()) for group in agent.groups()]
        return out

    def checkpoint_folders(self, step: int) -> list[Path]:
        return [f for agent in self.agents.values() for f in agent.checkpoint_folders(step)]

    def prune_saved(self) -> None:
        keep = set(self.checkpoints()[-self.cfg.trainer.keep_last_n:])
        for agent in self.agents.values():
            agent.prune(keep)

    def save(self) -> None:
        """Every model at this step; pruned once committed (at once unless asynchronous)."""
        started = time.perf_counter()
        rows = {"metrics_rows": self.metrics.rows()}
        seconds = [group.call(PPOWorker.save, str(root), self.step, {**state, **rows})
                   for group, root, state in self.saving_groups()]
        self.last_saved = self.step
        blocked = time.perf_counter() - started
        if self.stop is not None:
            self.stop.observe(save_s=blocked)
        self.log(f"checkpoint step {self.step} {'handed to the writers' if self.cfg.trainer.async_save else 'saved'} "
                 f"in {blocked:.1f} s (slowest rank {max(max(s) for s in seconds):.1f} s)")
        self.collect_saves()

    def collect_saves(self, blocking: bool = False) -> None:
        """Commit finished asynchronous saves on every group (``blocking``: wait for them),
        then prune. Every group's ranks take part (the commit is a collective per group)."""
        committed = []
        for group, _, _ in self.saving_groups():
            committed += [pair for rank in group.call(PPOWorker.finalize_saves, blocking) for pair in rank]
        if self.cfg.trainer.async_save and committed:
            self.log(f"checkpoint step(s) {sorted({step for _, step in committed})} committed")
        self.prune_saved()

    def restore(self, step: int, keep_scales: bool = False) -> list[dict]:
        """Every agent back to ``step``; returns the metrics rows its checkpoint had seen."""
        states = [agent.restore(step, keep_scales) for agent in self.agents.values()]
        self.step = self.last_saved = step
        return self.trim_metrics(step, (states[0] or {}).get("metrics_rows"))

    def rollback(self, name: str, reason: str) -> None:
        """Every agent back to the newest common checkpoint, with the lowered learning rates
        and raised KL weights of ``trainer.rollback``. When the same step fails again, one
        restore point further back each time: a replay from the newest draws the same prompts
        and samples, and when the newest policy is itself the one past the KL threshold, no
        learning rate rescues it. Checkpoints after the restored one are the rejected timeline:
        they are deleted, so neither a later rollback nor a resume lands on them."""
        failed, first = self.step + 1, next(iter(self.agents.values()))
        if self.cfg.trainer.async_save:
            self.collect_saves(blocking=True)  # a save in flight is of a good step
        why = reason if self.single else f"agent {name}: {reason}"
        where = first.ckpt_root if self.single else self.out / "agents"
        again = self.failed[1] if self.failed[0] == failed else 0
        saved = self.checkpoints()
        target = rollback_target(failed, why, saved, first.rollbacks, self.cfg.trainer.rollback,
                                 where, back=again)
        self.failed = (failed, again + 1)
        for agent in self.agents.values():
            agent.lower_rates()
            if target != saved[-1]:
                agent.prune({s for s in saved if s <= target})
        self.restore(target, keep_scales=True)
        done = (f"restored step {target}, lr scale now {first.lr_scale:g}, kl_coef now "
                f"{first.kl_ctrl.value:g}, kl_loss_coef now {first.kl_loss_coef:g}" if self.single
                else f"every agent restored to step {target}")
        if target != saved[-1]:
            done += (f" (step {failed} failed {again + 1} times in a row: stepped back past "
                     f"step(s) {', '.join(str(s) for s in saved if s > target)}, deleted)")
        self.log(f"rollback {first.rollbacks}/{self.cfg.trainer.rollback.max_rollbacks} at step "
                 f"{failed}: {why}; {done}")

    # ------------------------------------------------------------------ stops
    def stop_reason(self) -> str | None:
        """Why to stop at this boundary: a signal to the driver, to any worker, or the
        deadline; None to go on."""
        reason = self.stop.reason() if self.stop is not None else None
        if reason is None:
            for group in self.groups():
                names = [r for r in group.call(PPOWorker.stop_signal) if r]
                if names:
                    return f"{names[0]} received by worker group {group.name}"
        return reason

    def stop_now(self, reason: str):
        """Checkpoint this step (unless just saved), commit it, flush the logs, and raise
        :class:`RunStopped` (exit code 75)."""
        if self.last_saved != self.step:
            self.save()
        self.collect_saves(blocking=True)
        if self.logger is not None:
            self.logger.close()
            self.logger = None
        raise RunStopped(self.step, reason, str(self.out))


def check_inputs(cfg) -> None:
    """Before Ray is started: every checkpoint the workers will open (models, references,
    critics, reward models, and the newest checkpoint a resume would load) read through the
    restricted readers, so a planted file is one line here, not a worker's traceback. The
    workers check again where they load (``read_sharded``)."""
    from megatron_rlhf.checkpoint.train_ckpt import check_checkpoint_files, complete_checkpoints

    paths = [cfg.actor.model_path, cfg.actor.ref_model_path, cfg.critic.model_path,
             cfg.reward.model_path]
    for agent in cfg.agents or []:
        paths += [agent.model_path, agent.reference_path, agent.reward_model_path]
    out = Path(cfg.trainer.output_dir)
    if cfg.trainer.resume == "auto":
        roots = [out / "checkpoints" / role for role in ("actor", "critic")]
        roots += [out / "agents" / a.name / "checkpoints" / role for a in cfg.agents or []
                  for role in ("actor", "critic")]
        paths += [found[-1] for found in map(complete_checkpoints, roots) if found]
    for path in dict.fromkeys(str(p) for p in paths if p):
        check_checkpoint_files(path)


def finish(run: RLRun) -> dict[str, float]:
    """After the last step: the final checkpoint, committed, then the final validation (a
    failure there loses no training), then the finished marker."""
    last = run.history[-1] if run.history else {}
    if run.last_saved != run.step and (not run.checkpoints() or run.checkpoints()[-1] != run.step):
        run.save()
    run.collect_saves(blocking=True)
    every = run.cfg.trainer.eval_every_steps
    if not (every and run.step % every == 0):
        final = run.validate(run.step)
        if final:
            last = {**last, **final}
            run.record({"step": run.step, **final})
    if run.logger is not None:
        run.logger.close()
        run.logger = None
    mark_finished(run.out, run.cfg, run.step,
                  run.checkpoint_folders(run.step) + [run.metrics.path])
    return last
