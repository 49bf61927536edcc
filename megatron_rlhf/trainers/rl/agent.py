"""One agent of an RL run: its data, sampling, scoring, KL controller and checkpoints, and the
phases the loop in :mod:`~megatron_rlhf.trainers.rl.fit` calls on it, one method each.

Models live in Ray worker groups (:class:`PPOWorker`); the run's logs, joint checkpoints and
stops are :class:`~megatron_rlhf.trainers.rl.run.RLRun`'s. Everything the driver computes is pure tensor math on the
whole step's batch, so advantage whitening and group baselines see every sample.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_rlhf.algorithms import rollout_correction
from megatron_rlhf.algorithms.advantages import turn_rewards
from megatron_rlhf.algorithms.dapo import overlong_penalty
from megatron_rlhf.algorithms.ppo import (AdaptiveKLController, FixedKLController,
                                          explained_variance)
from megatron_rlhf.checkpoint.train_ckpt import complete_checkpoints
from megatron_rlhf.config.ppo_checks import reads_engine_logprobs, uses_critic, uses_reference
from megatron_rlhf.config.ppo_schema import PPOConfig
from megatron_rlhf.data.prompts import Prompt
from megatron_rlhf.errors import UserError
from megatron_rlhf.rewards.registry import RewardFunction
from megatron_rlhf.rewards.scorer import RewardScorer
from megatron_rlhf.rollout.base import Generation
from megatron_rlhf.orchestration.worker_group import stitch
from megatron_rlhf.trainers.rl.ahead import GenerationAhead
from megatron_rlhf.trainers.loop import epoch_order
from megatron_rlhf.trainers.rl.experience import (Experience, build_batch, engine_logprobs,
                                                   sample_kl, token_kl)
from megatron_rlhf.trainers.rl.routing import recorded_routing
from megatron_rlhf.trainers.rl.sampler import AgentSampling, reward_calls
from megatron_rlhf.trainers.rl.worker import PPOWorker


class Timer(dict):
    """``with timer("gen"):`` adds ``timing/gen`` seconds."""

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self[f"timing/{name}"] = self.get(f"timing/{name}", 0.0) + time.perf_counter() - start


def kl_controller(cfg: PPOConfig):
    k = cfg.algorithm.kl_ctrl
    if k.type == "adaptive":
        return AdaptiveKLController(k.kl_coef, k.target_kl, k.horizon)
    return FixedKLController(k.kl_coef)


def cat_rows(parts: list) -> torch.Tensor | None:
    """Data-parallel ranks' row blocks in order; ``None`` from a rank with no rows (fewer rows
    than ranks) or when nobody computed this output."""
    present = [p for p in parts if p is not None]
    return torch.cat(present) if present else None


@dataclass
class PPORun(GenerationAhead, AgentSampling):
    cfg: PPOConfig
    actor: object  # WorkerGroup with the actor role
    critic: object  # WorkerGroup with the critic role: its own, the actor's, or a judge's
    tokenizer: object
    train: list[Prompt]
    val: list[Prompt]
    stop_ids: list[int]
    reward_fn: RewardFunction | None  # reward.fn, resolved
    oracle_fn: RewardFunction | None  # reward.oracle_fn (default reward.fn), resolved
    total_steps: int
    steps_per_epoch: int
    kl_ctrl: object = None
    step: int = 0
    lr_scale: float = 1.0
    kl_loss_scale: float = 1.0  # rollbacks raise the KL-loss weight as they raise kl_ctrl's
    rollbacks: int = 0
    offline: list = field(default_factory=list)  # data.offline_files' OfflineGroups
    rewards: RewardScorer | None = None
    """Runs ``reward_fn`` / ``oracle_fn`` (a process pool with a per-call timeout, or in this
    process); made from them, in-process, when not given."""
    label: str = "ppo"
    """Log-line prefix (a multi-agent run's agents: ``agent <name>``)."""
    judged: bool = False
    """``critic`` is a judge group scoring other agents too (not this agent's to save)."""
    last_saved: int = -1  # the step of the newest checkpoint loaded
    rollout_group: object = None
    """A separate rollout group (``rollout.placement=separate``): it generates, fed by the
    actor group over a weight bridge; None when the engines share the actor's ranks."""
    engine_version: int = 0
    """The step whose weights the rollout engines hold (the trainer's after that many updates)."""
    inflight: dict = field(default_factory=dict)
    """``rollout.max_staleness > 0``: step -> :class:`InFlight` generation started ahead."""
    update_spans: dict = field(default_factory=dict)
    """step -> (start, end) wall-clock seconds of its update (``timing/overlap``)."""
    tools: object = None
    """``rollout.tools``' :class:`~megatron_rlhf.rollout.tool_turns.ToolEnv` (the run's, shared
    by its agents), or None: rollouts are then tool-free."""
    tool_metrics: dict = field(default_factory=dict)
    ahead_thread: object = None  # with tools and generation ahead: the thread that drives it

    def __post_init__(self):
        if self.rewards is None and (self.reward_fn is not None or self.oracle_fn is not None):
            fns = {"fn": self.reward_fn, "oracle": self.oracle_fn}
            self.rewards = RewardScorer({k: f for k, f in fns.items() if f is not None}, workers=0)

    @property
    def kl_loss_coef(self) -> float:
        """Weight of the actor's KL loss: ``actor.kl_loss_coef``, raised by rollbacks."""
        return self.cfg.actor.kl_loss_coef * self.kl_loss_scale

    @property
    def out(self) -> Path:
        return Path(self.cfg.trainer.output_dir)

    def log(self, message: str) -> None:
        print(f"[{self.label}] {message}", flush=True)

    # ------------------------------------------------------------------ data and rollout
    def step_indices(self, step: int) -> list[int]:
        """Indices into ``train`` of step ``step``'s prompts (epoch by epoch, seeded order)."""
        size = self.cfg.data.train_batch_size
        epoch, index = divmod(step, self.steps_per_epoch)
        order = epoch_order(len(self.train), self.cfg.trainer.seed, epoch, self.cfg.data.shuffle)
        return order[index * size:(index + 1) * size]

    def step_prompts(self, step: int) -> list[Prompt]:
        return [self.train[i] for i in self.step_indices(step)]

    def extra_indices(self, step: int, round_: int, count: int, exclude: set[int]) -> list[int]:
        """Fresh prompts for a further round of dynamic sampling, none already used this step;
        seeded by step and round, so a resumed run draws the same ones."""
        generator = torch.Generator().manual_seed(
            self.cfg.trainer.seed * 1_000_003 + step * 101 + round_)
        order = torch.randperm(len(self.train), generator=generator).tolist()
        return [i for i in order if i not in exclude][:count]

    def rollout(self, step: int, timer) -> tuple[list[Prompt], list[Generation], dict, dict, dict]:
        """Generate and score the step's samples: (prompts, generations, batch, scores,
        metrics). With ``algorithm.filter_groups`` in rounds (DAPO's dynamic sampling, see
        :mod:`megatron_rlhf.trainers.rl.dynamic_sampling`)."""
        if self.cfg.algorithm.filter_groups.enable:
            from megatron_rlhf.trainers.rl.dynamic_sampling import rollout_with_signal

            return rollout_with_signal(self, step, timer)
        prompts, offline = self.online_prompts(step), self.offline_groups(step)
        gens, metrics = [], {}
        if prompts:
            with timer("gen"):
                ahead = self.take_ahead(step)
                gens = ahead.pop("gens") if ahead else self.generate(
                    prompts, self.sampling(step), self.cfg.rollout.max_turns)
                metrics |= ahead or self.staleness(step, self.engine_version)
                metrics |= self.pop_tool_metrics()
        gens += [Generation(len(prompts) + i, list(s.tokens), list(s.logprobs), True)
                 for i, group in enumerate(offline) for s in group.samples]
        prompts = prompts + [group.prompt for group in offline]
        batch = build_batch([p.ids for p in prompts], gens, self.pad_id)
        with timer("reward_values"):
            scored = self.scores(prompts, gens, batch)
        if offline:
            metrics["offline/samples"] = float(sum(len(g.samples) for g in offline))
        return prompts, gens, batch, scored, metrics

    def online_prompts(self, step: int) -> list[Prompt]:
        """The step's prompts the engines answer (the rest of the step is offline data)."""
        prompts = self.step_prompts(step)
        return prompts[:len(prompts) - len(self.offline_groups(step))]

    def offline_groups(self, step: int) -> list:
        """This step's share of offline prompt groups (``data.offline_fraction``), drawn without
        replacement by a generator seeded with the step (a resumed run draws the same)."""
        count = round(self.cfg.data.offline_fraction * self.cfg.data.train_batch_size)
        if not self.offline or count == 0:
            return []
        generator = torch.Generator().manual_seed(self.cfg.trainer.seed * 7_000_003 + step)
        order = torch.randperm(len(self.offline), generator=generator).tolist()
        return [self.offline[i] for i in (order * (count // len(order) + 1))[:count]]

    def prepare_offline(self) -> None:
        """Behaviour log-probs the offline files lack: the starting policy's, computed once and
        saved with the run (``offline_logprobs.json``), so a resumed run uses the same ones."""
        missing = [s for group in self.offline for s in group.samples if s.logprobs is None]
        if not missing:
            return
        path = self.out / "offline_logprobs.json"
        if path.is_file():
            saved = json.loads(path.read_text())
            if len(saved) != len(missing):
                raise UserError(f"{path} holds {len(saved)} responses' log-probs, data.offline_files "
                                f"{len(missing)}: the files changed since the run started")
            for sample, values in zip(missing, saved):
                sample.logprobs = values
            return
        if self.step > 0:
            raise UserError(f"{path} is missing: the behaviour log-probs of data.offline_files "
                            "come from the starting policy, which a resumed run no longer has")
        pairs = [(group.prompt, s) for group in self.offline for s in group.samples
                 if s.logprobs is None]
        for start in range(0, len(pairs), 256):
            chunk = pairs[start:start + 256]
            gens = [Generation(i, s.tokens, [0.0] * len(s.tokens), True)
                    for i, (_, s) in enumerate(chunk)]
            batch = build_batch([p.ids for p, _ in chunk], gens, self.pad_id)
            old = cat_rows([part[0] for part in stitch(
                self.actor.call(PPOWorker.compute_log_probs, batch, True, False))])
            for row, (_, sample) in enumerate(chunk):
                first = int(batch["loss_mask"][row].nonzero()[0])
                sample.logprobs = old[row, first:first + len(sample.tokens)].tolist()
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps([s.logprobs for s in missing]))
        partial.replace(path)
        self.log(f"offline: behaviour log-probs of {len(missing)} responses computed by the "
                 f"starting policy (no behaviour_logprobs column), saved to {path}")

    # ------------------------------------------------------------------ scoring and experience
    def scores(self, prompts: list[Prompt], gens: list[Generation], batch: Experience) -> dict:
        """Sequence scores [N] (the training signal) and the oracle's, when one exists."""
        # Multi-turn samples are judged by their last turn (the oracle) and trained on every
        # turn's reward; single-turn ones by the whole response.
        texts = [self.tokenizer.decode(_last_turn(g), skip_special_tokens=True) for g in gens]
        calls = reward_calls(texts, [prompts[g.prompt_index] for g in gens], gens)
        values = rm = None
        if uses_critic(self.cfg) or self.cfg.reward.model_path:
            parts = stitch(self.critic.call(PPOWorker.compute_values, batch))
            values, rm = (cat_rows(p) for p in zip(*parts))
        batch["values"] = values
        batch["scores_from_rm"] = rm is not None  # SPPO's preference model (auto)
        r = self.cfg.reward
        score, turns, fn_scores = torch.zeros(len(gens)), None, None
        if rm is not None:
            score += r.rm_weight * rm
        if self.reward_fn is not None and gens[0].turn_scores is not None:
            fn_scores = [g.turn_scores[-1] for g in gens]  # the last turn, as the oracle judges
            score += r.fn_weight * torch.tensor([sum(g.turn_scores) for g in gens])
            turns = r.fn_weight * turn_rewards([g.turn_scores for g in gens], _turn_positions(batch, gens),
                                               batch["loss_mask"].shape[1])
        elif self.reward_fn is not None:
            fn_scores, per_turn = self.rewards.score_turns("fn", calls)
            if any(t is not None for t in per_turn):  # a tool trajectory's reward per turn
                lists = _turn_lists(per_turn, fn_scores, gens, r.fn)
                score += r.fn_weight * torch.tensor([sum(t) for t in lists])
                turns = r.fn_weight * turn_rewards(lists, _turn_positions(batch, gens),
                                                   batch["loss_mask"].shape[1])
            else:
                score += r.fn_weight * torch.tensor(fn_scores)
        out = {"score": score, "rm": rm, "turns": turns}
        if self.oracle_fn is not None:
            # The oracle defaults to reward.fn: reuse its scores rather than compute them twice.
            same = fn_scores is not None and self.rewards.same_function()
            out["oracle"] = torch.tensor(fn_scores if same else self.rewards.score("oracle", calls))
        if r.overlong_buffer.enable:
            o = r.overlong_buffer
            lengths = torch.tensor([len(g.tokens) for g in gens])
            out["overlong_penalty"] = overlong_penalty(lengths, self.cfg.data.max_response_length,
                                                       o.len, o.penalty_factor)
            score += out["overlong_penalty"]
        return out

    def fill_values(self, batch: Experience) -> None:
        """The critic's values [N, T] of a batch built after scoring (a play mode's training
        batch differs from the one it scored), when this agent's estimator needs them."""
        if uses_critic(self.cfg) and batch.get("values") is None:
            parts = stitch(self.critic.call(PPOWorker.compute_values, batch))
            batch["values"] = cat_rows(list(zip(*parts))[0])

    def oracle_scores(self, prompts: list[Prompt], gens: list[Generation]) -> torch.Tensor:
        """The oracle's scores [N] alone (no reward model, no shaping): accuracy, not signal."""
        texts = [self.tokenizer.decode(_last_turn(g), skip_special_tokens=True) for g in gens]
        calls = reward_calls(texts, [prompts[g.prompt_index] for g in gens], gens)
        return torch.tensor(self.rewards.score("oracle", calls))

    def reward_metrics(self) -> dict[str, float]:
        """``reward/errors``, ``reward/timeouts`` and the functions' extras since the last call
        (a step's rounds and turns included); each kind of failure logged once, naming the
        function."""
        if self.rewards is None:
            return {}
        metrics, lines = self.rewards.drain()
        for line in lines:
            self.log(line)
        return metrics

    def log_probs(self, batch: Experience, gens: list[Generation]) -> dict[str, float]:
        """Old (actor) and reference log-probs into ``batch``; returns how far the engine's own
        log-probs are from the actor's (a wrong weight sync shows up here first). Passes nothing
        uses are skipped: see :func:`uses_reference` and :func:`reuses_update_log_probs`."""
        bypass = self.cfg.algorithm.rollout_correction.bypass
        need_old = reads_engine_logprobs(self.cfg) and not bypass
        need_ref = uses_reference(self.cfg)
        if bypass:  # the engine's log-probs are the old ones: no trainer pass for them
            batch["old_logprobs"] = engine_logprobs(gens, batch["loss_mask"])
        if not (need_old or need_ref):
            return {}
        parts = stitch(self.actor.call(PPOWorker.compute_log_probs, batch, need_old, need_ref))
        old, ref, own, used = (cat_rows(p) for p in zip(*parts))
        batch["ref_logprobs"] = ref
        if old is None:
            return {}
        batch["old_logprobs"] = old
        engine = engine_logprobs(gens, batch["loss_mask"])
        gap = (engine - old).abs() * batch["loss_mask"]
        mask = batch["loss_mask"]
        return ({"rollout/logprob_diff_max": float(gap.max()),
                 "rollout/logprob_diff_mean": float(gap.sum() / mask.sum().clamp(min=1))}
                | recorded_routing(batch, own, self.cfg.actor.router_replay, used)
                | self.correct(batch, old, engine))

    def correct(self, batch: Experience, old: torch.Tensor, engine: torch.Tensor) -> dict[str, float]:
        """Rollout correction (``algorithm.rollout_correction``): IS weights into the batch,
        tokens a token-level rejection drops out of ``loss_mask`` now (before the advantages, as
        verl), samples a sequence-level one drops out of ``train_rows``; returns its metrics."""
        c, mask = self.cfg.algorithm.rollout_correction, batch["loss_mask"]
        if c.mode == "none":
            return {}
        out = rollout_correction.correct(old, engine, mask, c)
        if out.weights is not None:
            batch["is_weights"] = out.weights
        if out.rows is not None:
            batch["train_rows"] = batch.get("train_rows", torch.ones_like(out.rows)) & out.rows
        if out.tokens is not None:
            batch["response_mask"], batch["loss_mask"] = mask, mask * out.tokens
        return out.metrics

    def leave_out_untrained(self, gens: list[Generation], batch: Experience) -> None:
        """Zero the loss mask of samples the update must not train on: dynamic sampling's
        filler groups, samples the rollout correction masks and (``actor.overlong_filter``)
        truncated ones. They stay in the batch (its size is what the layout divides), and
        ``response_mask`` keeps every response for the rollout's statistics."""
        rows = batch.get("train_rows", torch.ones(len(gens), dtype=torch.bool))
        if self.cfg.actor.overlong_filter:
            rows = rows & torch.tensor([g.finished for g in gens])
        if not bool(rows.all()):
            batch.setdefault("response_mask", batch["loss_mask"])  # a token rejection's is older
            batch["loss_mask"] = batch["loss_mask"] * rows[:, None]

    def advance_kl(self, adv: dict, batch: Experience) -> dict[str, float]:
        """After an accepted update: the KL coefficients the step used (the adaptive controller
        then moves the in-reward one, as verl: it steers nothing else) and the rollout's KL to
        the reference."""
        mask, out = batch["loss_mask"], {}
        if self.cfg.algorithm.use_kl_in_reward:
            out["actor/kl_coef"] = self.kl_ctrl.value
            self.kl_ctrl.update(sample_kl(adv["kl"], mask), mask.shape[0])
        if self.cfg.actor.use_kl_loss:
            out["actor/kl_loss_coef"] = self.kl_loss_coef
        if batch.get("ref_logprobs") is not None and batch.get("old_logprobs") is not None:
            out["rollout/kl_ref"] = token_kl(adv["kl"], mask)
        return out

    # ------------------------------------------------------------------ validation
    def validate(self, step: int) -> dict[str, float]:
        if not self.val:
            return {}
        gens = self.generate(self.val, self.sampling(10 ** 9 + step, validation=True))
        batch = build_batch([p.ids for p in self.val], gens, self.pad_id)
        scored = self.scores(self.val, gens, batch)
        failures = self.reward_metrics()  # validation's own calls: logged, not the step's
        out = {"val/score_mean": float(scored["score"].mean()),
               "val/response_length": float(batch["loss_mask"].sum(1).mean())}
        if scored.get("oracle") is not None:
            out["val/oracle_acc"] = float(scored["oracle"].mean())
        if failures.get("reward/errors") or failures.get("reward/timeouts"):
            out["val/reward_failures"] = failures["reward/errors"] + failures["reward/timeouts"]
        if scored["rm"] is not None:
            out["val/rm_score"] = float(scored["rm"].mean())
        self.log(f"validation at step {step}: " + ", ".join(f"{k[4:]} {v:.4f}" for k, v in out.items()))
        example = self.tokenizer.decode(list(self.val[0].ids) + gens[0].tokens, skip_special_tokens=False)
        self.log(f"example: {example!r}")
        return out

    @property
    def pad_id(self) -> int:
        from megatron_rlhf.data.chat import pad_id

        return pad_id(self.tokenizer)

    # ------------------------------------------------------------------ checkpoints
    @property
    def ckpt_root(self) -> Path:
        return self.out / "checkpoints"

    def state(self) -> dict:
        return {"step": self.step, "kl_ctrl": self.kl_ctrl.state_dict(), "lr_scale": self.lr_scale,
                "kl_loss_scale": self.kl_loss_scale, "rollbacks": self.rollbacks}

    def groups(self) -> list:
        """This agent's worker groups that hold models to save, each once (the critic's is the
        actor's when shared; a judge is the run's, not the agent's)."""
        own = [self.actor] if self.judged else [self.actor, self.critic]
        return list({id(g): g for g in own}.values())

    def sync_weights(self, version: int) -> dict[str, float]:
        """The actor's weights (those of step ``version``) into its rollout engines: on its own
        ranks, or over the bridge into the separate rollout group (both groups take part
        together; on its ranks the receive follows any generation started ahead). Returns
        ``rollout/tool_rounds_at_sync`` with tools ahead: steps whose rounds it waited for."""
        waited = self.wait_ahead()  # with tools: their turns stay on the weights they started with
        self.engine_version = version
        if self.rollout_group is None:
            self.actor.call(PPOWorker.sync_weights)
            return {}
        from megatron_rlhf.orchestration.worker_group import call_together
        from megatron_rlhf.trainers.rl.rollout_worker import RolloutWorker

        call_together((self.actor, PPOWorker.sync_weights),
                      (self.rollout_group, RolloutWorker.receive_weights))
        return {"rollout/tool_rounds_at_sync": float(waited)} if self.tools is not None else {}

    def checkpoint_folders(self, step: int) -> list[Path]:
        return [self.ckpt_root / role / f"step_{step:08d}" for role in self.roles]

    @property
    def roles(self) -> tuple[str, ...]:
        """The trained models, each checkpointed in its own folder."""
        return ("actor", "critic") if uses_critic(self.cfg) else ("actor",)

    def checkpoints(self) -> list[int]:
        """Steps with a checkpoint of every trained model (actor, and critic for GAE), oldest first."""
        steps = [{int(p.name[5:]) for p in complete_checkpoints(self.ckpt_root / role)}
                 for role in self.roles]
        return sorted(set.intersection(*steps))

    def prune(self, keep: set[int] | None = None) -> None:
        """Keep the newest ``trainer.keep_last_n`` steps that every model has (or the steps
        ``keep``: a multi-agent run's common ones), and nothing else.

        Pruning only after all models saved means a kill between two models' saves still leaves
        a common step to resume from; checkpoints of one model alone (such a kill, or the steps
        of a timeline a resume or rollback abandoned) go at the next save.
        """
        if keep is None:
            keep = set(self.checkpoints()[-self.cfg.trainer.keep_last_n:])
        for role in self.roles:
            for path in complete_checkpoints(self.ckpt_root / role):
                if int(path.name[5:]) not in keep:
                    shutil.rmtree(path)

    def saved_state(self, step: int) -> dict:
        """The driver state checkpoint ``step`` holds (read before any worker loads it)."""
        path = self.ckpt_root / "actor" / f"step_{step:08d}" / "trainer_state.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise UserError(f"{path}: cannot be read ({err})") from None

    def restore(self, step: int, keep_scales: bool = False) -> dict:
        """Load checkpoint ``step`` everywhere; the saved driver state unless ``keep_scales``.
        Returns that state (its ``metrics_rows``: what :meth:`trim_metrics` keeps)."""
        state = self.saved_state(step)
        if not keep_scales:
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])
            self.lr_scale, self.rollbacks = state["lr_scale"], state["rollbacks"]
            self.kl_loss_scale = state.get("kl_loss_scale", 1.0)  # absent before it existed
        for group in self.groups():
            group.call(PPOWorker.load, str(self.ckpt_root), step, self.lr_scale)
        self.step = self.last_saved = step
        if self.rollout_group is not None:
            self.cancel_ahead()
        self.sync_weights(step)
        return state

    # ------------------------------------------------------------------ guard
    def guard_reason(self, metrics: dict[str, float]) -> str | None:
        """Why this step's update must be undone, or None."""
        bad = [k for k, v in metrics.items() if k.startswith(("actor/", "critic/")) and not math.isfinite(v)]
        if bad:
            return f"{bad[0]} is {metrics[bad[0]]}"
        limit = self.cfg.trainer.rollback.kl_threshold
        if not limit or "actor/pg_loss" not in metrics:  # no guard, or no actor update to judge
            return None
        if "actor/kl" not in metrics:  # the guard loads a reference (uses_reference): a bug
            raise RuntimeError(f"trainer.rollback.kl_threshold={limit} is set but this step's "
                               "actor update reported no actor/kl")
        if metrics["actor/kl"] > limit:
            return f"actor/kl {metrics['actor/kl']:.4g} exceeds trainer.rollback.kl_threshold={limit}"
        return None

    def lower_rates(self) -> None:
        """One more rollback: the learning rate down, the KL weights up (``trainer.rollback``)."""
        rb = self.cfg.trainer.rollback
        self.rollbacks += 1
        self.lr_scale *= rb.lr_factor
        self.kl_ctrl.value *= rb.kl_coef_factor
        self.kl_loss_scale *= rb.kl_coef_factor


def rollback_target(failed: int, reason: str, saved: list[int], rollbacks: int, rb,
                    where: Path, back: int = 0) -> int:
    """The saved step to go back to after step ``failed`` went bad: the newest, or ``back``
    restore points before it (the oldest kept when there are fewer), or the error that stops
    the run (nothing saved, or ``rb.max_rollbacks`` spent)."""
    if not saved:
        raise UserError(f"step {failed}: {reason}; no checkpoint to roll back to "
                        f"(set trainer.save_every_steps); stopped")
    if rollbacks >= rb.max_rollbacks:
        raise UserError(f"step {failed}: {reason}; already rolled back {rollbacks} times "
                        f"(trainer.rollback.max_rollbacks); stopped. Checkpoints in {where} are intact")
    return saved[-1 - min(back, len(saved) - 1)]


def close_step(run, metrics: dict, samples: int, tokens: float, shown: dict) -> None:
    """After an accepted update of ``run`` (an :class:`~megatron_rlhf.trainers.rl.run.RLRun`,
    its step already advanced): count throughput, log progress, validate, record, save, as ``trainer.*`` says;
    stop cleanly (:meth:`RLRun.stop_now`) if a signal or the deadline asks."""
    t = run.cfg.trainer
    metrics["step"] = run.step
    run.logger.count(samples, tokens)
    if run.step % t.log_every_steps == 0 or run.step == run.total_steps:
        metrics |= run.logger.progress(run.step, "samples", shown)
    if t.eval_every_steps and run.step % t.eval_every_steps == 0:
        metrics |= run.validate(run.step)
    run.record(metrics)
    if t.save_every_steps and run.step % t.save_every_steps == 0:
        run.save()
    else:
        run.collect_saves()  # asynchronous saves that finished meanwhile
    if run.stop is not None:
        run.stop.observe(step_s=sum(v for k, v in metrics.items()
                                    if k.startswith("timing/") and k != "timing/overlap"))
    if run.step < run.total_steps and (reason := run.stop_reason()):
        run.stop_now(reason)


def _turn_positions(batch: Experience, gens: list[Generation]) -> list[list[int]]:
    """Each sample's turn ends as columns of the batch (its response starts at the first
    position of its loss mask)."""
    return [[int(batch["loss_mask"][row].nonzero()[0]) + end for end in (g.turn_ends or [len(g.tokens) - 1])]
            for row, g in enumerate(gens)]


def _turn_lists(per_turn: list, scores: list[float], gens: list[Generation], fn: str) -> list[list[float]]:
    """Per-turn rewards of a batch where a reward function returned ``turn_scores``: a sample
    without them gets its score on its last turn; a list of the wrong length is an error."""
    out = []
    for k, (turns, score, g) in enumerate(zip(per_turn, scores, gens)):
        count = len(g.turn_ends or [0])
        if turns is None:
            out.append([0.0] * (count - 1) + [score])
        elif len(turns) != count:
            raise UserError(f"reward.fn {fn!r} returned {len(turns)} turn_scores for sample {k}, a "
                            f"trajectory of {count} assistant turn(s): give one per turn")
        else:
            out.append(list(turns))
    return out


def _last_turn(g: Generation) -> list[int]:
    if g.mask is None:
        return g.tokens
    start = max((i + 1 for i, m in enumerate(g.mask) if m == 0), default=0)
    return g.tokens[start:]


def summarize_rollout(gens: list[Generation], scored: dict, batch: Experience, adv: dict) -> dict:
    mask = batch.get("response_mask", batch["loss_mask"])  # every response, trained or not
    lengths = mask.sum(dim=1)
    out = {"reward/score_mean": float(scored["score"].mean()),
           "reward/score_median": float(statistics.median(scored["score"].tolist())),
           "response/length_mean": float(lengths.mean()),
           "response/clip_ratio": float(sum(not g.finished for g in gens) / len(gens)),
           "critic/returns_mean": float((adv["returns"] * mask).sum() / mask.sum()),
           "critic/advantages_mean": float((adv["advantages"] * mask).sum() / mask.sum())}
    if batch.get("values") is not None:
        out["critic/values_mean"] = float((batch["values"] * mask).sum() / mask.sum())
        out["critic/vf_explained_var"] = explained_variance(batch["values"], adv["returns"], mask)
    if scored.get("oracle") is not None:
        out["reward/oracle_mean"] = float(scored["oracle"].mean())
    if scored["rm"] is not None:
        out["reward/rm_mean"] = float(scored["rm"].mean())
    if gens[0].turn_ends is not None:
        out["response/turns_mean"] = sum(len(g.turn_ends) for g in gens) / len(gens)
    if scored.get("overlong_penalty") is not None:
        out["reward/overlong_penalty_mean"] = float(scored["overlong_penalty"].mean())
    if "response_mask" in batch:
        out["actor/trained_fraction"] = float((batch["loss_mask"].sum(1) > 0).float().mean())
    return out
