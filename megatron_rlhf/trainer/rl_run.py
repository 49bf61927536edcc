"""What a PPO run and a multi-agent run share about their logs, checkpoints and stops.

Both keep ``metrics.jsonl`` (one row per step, a resume cuts it back to the rows its checkpoint
had seen), save every worker group's models at step boundaries (committed at once, or later
when ``trainer.async_save``), prune only what every model has committed, and stop cleanly on a
signal (to the driver, or to any worker) or ``trainer.stop_at``.
"""

from __future__ import annotations

import time

from megatron_rlhf.errors import RunStopped
from megatron_rlhf.trainer.lifecycle import MetricsFile, mark_finished
from megatron_rlhf.trainer.ppo_worker import PPOWorker


class RLRunState:
    """Mixed into :class:`~megatron_rlhf.trainer.ppo_driver.PPORun` and
    :class:`~megatron_rlhf.multi_agent.driver.MultiAgentRun`, which provide ``cfg``, ``out``,
    ``step``, ``total_steps``, ``logger``, ``history``, ``stop`` and ``last_saved``, and:

    - ``saving_groups()``: ``[(worker group, checkpoint root, trainer state)]`` to save;
    - ``stop_groups()``: every worker group (any may have received a stop signal itself);
    - ``checkpoints()``: the steps every model has committed;
    - ``checkpoint_folders(step)``: every model's checkpoint folder of ``step``;
    - ``prune_saved()``: delete what ``trainer.keep_last_n`` no longer keeps.
    """

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

    def stop_reason(self) -> str | None:
        """Why to stop at this boundary: a signal to the driver, to any worker, or the
        deadline; None to go on."""
        reason = self.stop.reason() if self.stop is not None else None
        if reason is None:
            for group in self.stop_groups():
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
    from pathlib import Path

    from megatron_rlhf.checkpoint.train_ckpt import check_checkpoint_files, complete_checkpoints

    paths = [cfg.actor.model_path, cfg.actor.ref_model_path, cfg.critic.model_path,
             cfg.reward.model_path]
    for agent in cfg.agents or []:
        paths += [agent.model_path, agent.reference_path, agent.reward_model_path]
    out = Path(cfg.trainer.output_dir)
    if cfg.trainer.resume == "auto":
        roots = [out / "checkpoints" / role for role in ("actor", "critic")]
        roots += [out / "agents" / a.name / "checkpoints" / "actor" for a in cfg.agents or []]
        paths += [found[-1] for found in map(complete_checkpoints, roots) if found]
    for path in dict.fromkeys(str(p) for p in paths if p):
        check_checkpoint_files(path)


def finish(run) -> dict[str, float]:
    """After the last step (a PPORun or a MultiAgentRun): the final checkpoint, committed, then
    the final validation (a failure there loses no training), then the finished marker."""
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
