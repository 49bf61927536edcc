"""Start-up validation of the PPO config: every error names the key and the numbers."""

from __future__ import annotations

from megatron_rlhf.agent_tools.spec import check_tool_settings
from megatron_rlhf.algorithms.estimators import ESTIMATORS, estimator
from megatron_rlhf.algorithms.policy_losses import POLICY_LOSSES
from megatron_rlhf.algorithms.ppo import AGG_MODES, KL_ESTIMATORS
from megatron_rlhf.algorithms.rollout_correction import MASK_LEVELS, TIS_LEVELS
from megatron_rlhf.algorithms.sppo import PREFERENCES, TARGETS
from megatron_rlhf.config.loader import check_optim, check_positive
from megatron_rlhf.config.lora import check_ppo_lora
from megatron_rlhf.config.parallel import check_parallel
from megatron_rlhf.config.ppo_schema import PPOConfig
from megatron_rlhf.config.sglang import check_sglang_settings
from megatron_rlhf.config.stopping import check_stop_settings
from megatron_rlhf.distributed.engine_placement import check_engine_layout
from megatron_rlhf.errors import UserError
from megatron_rlhf.monitoring import logger_kinds

ADV_ESTIMATORS = tuple(ESTIMATORS)
GROUP_ESTIMATORS = tuple(name for name, e in ESTIMATORS.items() if e.group_based)


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise UserError(f"config: {name}={value!r} must be one of {', '.join(map(str, allowed))}")


def uses_reference(cfg: PPOConfig) -> bool:
    """Whether the run needs the reference model's log-probs."""
    return (cfg.algorithm.ref_log_prob == "always" or cfg.algorithm.use_kl_in_reward
            or cfg.actor.use_kl_loss or cfg.trainer.rollback.kl_threshold > 0)


def builds_reference_model(cfg: PPOConfig) -> bool:
    """Whether a second, frozen policy is built for the reference log-probs: the run uses them
    (:func:`uses_reference`) and the actor has no LoRA adapters (with adapters the reference is
    the actor's own base, run with them switched off: ``trainers/rl/policy.reference_policy``).
    The planner counts its memory by this rule."""
    return uses_reference(cfg) and not cfg.actor.lora.rank


def reuses_update_log_probs(cfg: PPOConfig) -> bool:
    """On-policy updates (one epoch, one mini-batch per step): the old policy *is* the policy
    being updated, so its log-probs come from the update's own forward (ratio exactly 1, as in
    TRL and verl) instead of a separate pass. An in-reward KL still needs them beforehand."""
    a = cfg.actor
    samples = cfg.data.train_batch_size * cfg.rollout.n
    return (a.ppo_epochs == 1 and a.ppo_mini_batch_size >= samples
            and not cfg.algorithm.use_kl_in_reward
            and correction_mode(cfg) == "none"  # it compares them to the engine's
            and cfg.actor.router_replay == "none"  # R2 records the old pass; R3 measures it
            and not cfg.algorithm.rollout_correction.bypass)  # the engine's are the old ones


def correction_mode(cfg: PPOConfig) -> str:
    """``algorithm.rollout_correction.mode`` with ``auto`` resolved: token TIS when rollouts may
    be stale (and the engine's log-probs are not taken as the old ones), else none."""
    c, stale = cfg.algorithm.rollout_correction, cfg.rollout.max_staleness > 0
    if c.mode != "auto":
        return c.mode
    return "tis" if stale and not c.bypass else "none"


def validate_ppo_config(cfg: PPOConfig) -> PPOConfig:
    """Checks that need no model or process group (layout checks follow in the workers)."""
    d, a, r, alg, t = cfg.data, cfg.actor, cfg.rollout, cfg.algorithm, cfg.trainer
    correction = alg.rollout_correction
    correction.mode = correction_mode(cfg)  # stale rollouts are corrected unless told otherwise
    if not a.model_path and not cfg.agents:
        raise UserError("config: missing required value for actor.model_path")
    if not d.train_files:
        raise UserError("config: data.train_files is empty")
    for name, value in (("data.max_prompt_length", d.max_prompt_length),
                        ("data.max_response_length", d.max_response_length),
                        ("data.train_batch_size", d.train_batch_size),
                        ("actor.ppo_mini_batch_size", a.ppo_mini_batch_size),
                        ("actor.ppo_micro_batch_size_per_rank", a.ppo_micro_batch_size_per_rank),
                        ("actor.ppo_epochs", a.ppo_epochs), ("actor.clip_ratio", a.clip_ratio),
                        ("rollout.n", r.n),
                        ("rollout.tp", r.tp), ("rollout.bucket_size_mb", r.bucket_size_mb),
                        ("rollout.max_turns", r.max_turns),
                        ("trainer.total_epochs", t.total_epochs),
                        ("trainer.n_gpus_per_node", t.n_gpus_per_node), ("trainer.nnodes", t.nnodes),
                        ("trainer.log_every_steps", t.log_every_steps),
                        ("trainer.keep_last_n", t.keep_last_n)):
        check_positive(name, value)
    _check_actor_passes(cfg)
    _check_ranges(cfg)
    _choice("data.overlong", d.overlong, ("drop", "truncate"))
    _choice("algorithm.adv_estimator", alg.adv_estimator, ADV_ESTIMATORS)
    _choice("algorithm.kl_penalty", alg.kl_penalty, KL_ESTIMATORS)
    _choice("algorithm.ref_log_prob", alg.ref_log_prob, ("auto", "always"))
    if r.max_turns > 1 and not cfg.reward.fn:
        raise UserError(f"config: rollout.max_turns={r.max_turns} needs reward.fn, which decides "
                        "after each turn whether the policy gets another try")
    _choice("algorithm.kl_ctrl.type", alg.kl_ctrl.type, ("fixed", "adaptive"))
    _choice("actor.kl_loss_type", a.kl_loss_type, KL_ESTIMATORS)
    _choice("actor.loss_agg_mode", a.loss_agg_mode, AGG_MODES)
    _choice("actor.dtype", a.dtype, ("auto", "float32", "bfloat16"))
    _choice("rollout.backend", r.backend, ("hf", "sglang"))
    _choice("rollout.dtype", r.dtype, ("auto", "float32", "bfloat16", "float16"))
    _choice("resource_pool.critic", cfg.resource_pool.critic, ("shared", "separate"))
    _choice("actor.router_replay", a.router_replay, ("none", "R2", "R3"))
    _check_offload(cfg)
    check_parallel("actor.parallel", a.parallel, a.moe)
    check_ppo_lora(cfg)
    if cfg.critic.parallel is not None:
        check_parallel("critic.parallel", cfg.critic.parallel, cfg.critic.moe)
    logger_kinds(t.logger)  # one of, or a list of, console/tensorboard/wandb
    _choice("trainer.resume", t.resume, ("auto", "disable"))
    check_stop_settings(t)
    _check_recipes(cfg)
    _check_reward(cfg)
    if check_tool_settings(r):  # names, functions, schemas, formats of rollout.tools
        _check_tool_combinations(cfg)
    if alg.adv_estimator in GROUP_ESTIMATORS and r.n < 2:
        raise UserError(f"config: algorithm.adv_estimator={alg.adv_estimator} compares samples of "
                        f"one prompt; set rollout.n >= 2 (got {r.n})")
    if not (cfg.reward.model_path or cfg.reward.fn or any(g.reward_model_path for g in cfg.agents)):
        raise UserError("config: set reward.model_path (a reward model) and/or reward.fn "
                        "(a rule-based reward)")
    if a.clip_ratio_c and a.clip_ratio_c <= 1:
        raise UserError(f"config: actor.clip_ratio_c={a.clip_ratio_c} must exceed 1 (0 disables)")
    if not 0 < alg.gamma <= 1 or not 0 <= alg.lam <= 1:
        raise UserError(f"config: algorithm.gamma={alg.gamma} must be in (0, 1] and "
                        f"algorithm.lam={alg.lam} in [0, 1]")
    samples = d.train_batch_size * r.n
    if samples % a.ppo_mini_batch_size:
        raise UserError(f"config: a step's {samples} samples (data.train_batch_size x rollout.n) "
                        f"are not divisible by actor.ppo_mini_batch_size={a.ppo_mini_batch_size}")
    _check_trainer_steps(cfg)
    if cfg.critic.ppo_epochs is not None:
        check_positive("critic.ppo_epochs", cfg.critic.ppo_epochs)
    if alg.kl_ctrl.type == "adaptive":
        check_positive("algorithm.kl_ctrl.target_kl", alg.kl_ctrl.target_kl)
        check_positive("algorithm.kl_ctrl.horizon", alg.kl_ctrl.horizon)
    check_sglang_settings(r)
    _check_rollout_layout(cfg)
    return cfg


def _check_tool_combinations(cfg: PPOConfig) -> None:
    """What tool rollouts run with. Refused: what drives its own generation (the retry
    dialogue, dynamic sampling's rounds; the play modes are checked with ``agents``), offline
    samples, prompts cut from the left (the schemas are at their start), and SGLang, not yet run
    with tools."""
    r, d = cfg.rollout, cfg.data
    refused = [(r.max_turns > 1, f"rollout.max_turns={r.max_turns} (the retry dialogue)"),
               (cfg.algorithm.filter_groups.enable, "algorithm.filter_groups"),
               (d.offline_fraction > 0, "data.offline_fraction"),
               (d.overlong == "truncate", "data.overlong=truncate (it cuts prompts from the "
                "left, where the chat template puts the tool schemas)"),
               (r.backend == "sglang", "rollout.backend=sglang (token ids in like hf, but not "
                "run with tools yet: no GPU test; use rollout.backend=hf)")]
    for bad, what in refused:
        if bad:
            raise UserError(f"config: rollout.tools is not supported with {what}")


def _check_trainer_steps(cfg: PPOConfig) -> None:
    """Step counts, the critic's warm-up and the rollback guard's factors."""
    t, alg = cfg.trainer, cfg.algorithm
    for name in ("save_every_steps", "eval_every_steps", "max_steps"):
        if getattr(t, name) < 0:
            raise UserError(f"config: trainer.{name}={getattr(t, name)} must be >= 0 (0: off)")
    if t.critic_warmup < 0 or (t.critic_warmup and not estimator(alg.adv_estimator).needs_critic):
        raise UserError(f"config: trainer.critic_warmup={t.critic_warmup} must be >= 0, and is for "
                        f"a critic (algorithm.adv_estimator=gae, not {alg.adv_estimator})")
    rb = t.rollback
    if rb.kl_threshold < 0 or not 0 < rb.lr_factor <= 1 or rb.kl_coef_factor < 1 or rb.max_rollbacks < 0:
        raise UserError("config: trainer.rollback needs kl_threshold >= 0, 0 < lr_factor <= 1, "
                        f"kl_coef_factor >= 1, max_rollbacks >= 0 (got {rb})")


def _check_offload(cfg: PPOConfig) -> None:
    """Frozen models have no gradients or optimizer to offload; offload is a colocated engine's."""
    for name, off in (("actor.ref_offload", cfg.actor.ref_offload), ("reward.offload", cfg.reward.offload)):
        if off.grads or off.optimizer:
            raise UserError(f"config: {name} holds a frozen model: only {name}.params can be set "
                            f"(got grads={off.grads}, optimizer={off.optimizer})")
    if cfg.rollout.placement == "separate" and cfg.actor.offload.params:
        raise UserError("config: actor.offload.params frees the trainer's GPUs for a colocated "
                        "engine; with rollout.placement=separate the engines have GPUs of their "
                        "own (offload grads/optimizer only, or place the engines colocated)")
    trained = (cfg.actor.offload, cfg.critic.offload)
    if cfg.trainer.async_save and any(o.params or o.optimizer for o in trained):
        raise UserError("config: trainer.async_save with actor.offload / critic.offload params or "
                        "optimizer is not supported: the background writer may still read tensors "
                        "the offload frees after the save returns (use a synchronous save)")


def _check_actor_passes(cfg: PPOConfig) -> None:
    """Token-budget micro-batches and the chunked log-prob head."""
    d, a = cfg.data, cfg.actor
    if a.ppo_micro_batch_tokens_per_rank:
        sample = d.max_prompt_length + d.max_response_length
        if a.ppo_micro_batch_tokens_per_rank < sample:
            raise UserError(f"actor.ppo_micro_batch_tokens_per_rank="
                            f"{a.ppo_micro_batch_tokens_per_rank} cannot hold one sample of "
                            f"data.max_prompt_length + data.max_response_length = {sample} tokens")
        if not d.use_remove_padding:
            raise UserError("actor.ppo_micro_batch_tokens_per_rank packs samples: it needs "
                            "data.use_remove_padding=true")
    if d.share_prompts and not d.use_remove_padding:
        raise UserError("data.share_prompts=true lays a group's replies after one copy of "
                        "their prompt in packed rows: it needs data.use_remove_padding=true")
    if a.logprob_chunk_tokens < 0:
        raise UserError(f"actor.logprob_chunk_tokens must be >= 0 (0: full logits), got "
                        f"{a.logprob_chunk_tokens}")


def reads_engine_logprobs(cfg: PPOConfig) -> bool:
    """Whether anything reads the rollout engine's log-probs: the bypass (they are the old ones)
    or the old-log-prob pass (the mismatch metric and the rollout correction)."""
    return cfg.algorithm.rollout_correction.bypass or not reuses_update_log_probs(cfg)


def _check_rollout_layout(cfg: PPOConfig) -> None:
    """Engine experts, placement, the separate group's size and staleness."""
    r, alg = cfg.rollout, cfg.algorithm
    check_positive("rollout.ep", r.ep)
    check_positive("rollout.world_size", r.world_size)
    if r.placement not in ("colocated", "separate"):
        raise UserError(f"config: rollout.placement={r.placement!r} must be colocated or separate")
    if r.max_staleness < 0 or (r.max_staleness and r.placement != "separate"):
        raise UserError(f"config: rollout.max_staleness={r.max_staleness} must be >= 0, and "
                        "> 0 only with rollout.placement=separate (colocated engines share the "
                        "trainer's devices: nothing runs while they generate)")
    # With bypass a stale engine's log-probs are the behaviour policy's, the one that sampled:
    # the PPO ratio against them is off-policy PPO's own (verl's bypass mode, one-step-off).
    if r.max_staleness and (alg.filter_groups.enable or r.max_turns > 1
                            or cfg.multi_agent.mode != "solo"):
        raise UserError(f"config: rollout.max_staleness={r.max_staleness} generates whole steps "
                        "ahead: not with algorithm.filter_groups, rollout.max_turns > 1 or a "
                        "multi_agent.mode other than solo (not built)")
    if r.placement == "separate" and r.world_size % r.tp:
        raise UserError(f"config: rollout.tp={r.tp} does not divide the separate rollout group's "
                        f"rollout.world_size={r.world_size} ranks")
    if r.tp % r.ep or (r.backend == "hf" and r.ep not in (1, r.tp)):
        allowed = f"1 or rollout.tp={r.tp}" if r.backend == "hf" else f"a divisor of rollout.tp={r.tp}"
        raise UserError(f"config: rollout.ep={r.ep} must be {allowed} (experts are split over "
                        f"the GPUs of an engine; backend {r.backend})")


def _check_ranges(cfg: PPOConfig) -> None:
    """Optimizers, clip ratios, sampling parameters and the critic pool size."""
    a, r = cfg.actor, cfg.rollout
    if not 0 < r.gpu_memory_utilization < 1:
        raise UserError(f"config: rollout.gpu_memory_utilization={r.gpu_memory_utilization} must "
                        "be between 0 and 1 (a fraction of each GPU)")
    check_optim("actor.optim", a.optim)
    check_optim("critic.optim", cfg.critic.optim)
    for name in ("clip_ratio_low", "clip_ratio_high"):
        if getattr(a, name) is not None:
            check_positive(f"actor.{name}", getattr(a, name))
    if cfg.resource_pool.critic == "separate":
        check_positive("resource_pool.critic_world_size", cfg.resource_pool.critic_world_size)
    for name in ("temperature", "val_temperature"):
        if not getattr(r, name) >= 0:
            raise UserError(f"config: rollout.{name}={getattr(r, name)} must be >= 0")
    if not 0 < r.top_p <= 1:
        raise UserError(f"config: rollout.top_p={r.top_p} must be in (0, 1]")
    if r.top_k < -1:
        raise UserError(f"config: rollout.top_k={r.top_k} must be >= -1 (0 or -1: off)")


def optimizer_steps(cfg: PPOConfig, total_steps: int, samples_per_step: int,
                    critic: bool = True) -> dict[str, int]:
    """Optimizer steps each trained model takes over the run (the length of its LR schedule):
    the update makes one per ``ppo_mini_batch_size`` samples, a partial last one included."""
    per_epoch = -(-samples_per_step // cfg.actor.ppo_mini_batch_size)
    return {"actor": total_steps * cfg.actor.ppo_epochs * per_epoch,
            "critic": total_steps * critic_epochs(cfg) * per_epoch if critic else 0}


# Settings derived from others, decided here once.
def uses_critic(cfg: PPOConfig) -> bool:
    """The estimator learns a value baseline: a critic is built and trained."""
    return estimator(cfg.algorithm.adv_estimator).needs_critic


def critic_epochs(cfg: PPOConfig) -> int:
    return cfg.critic.ppo_epochs or cfg.actor.ppo_epochs


def critic_parallel(cfg: PPOConfig):
    """The critic's (and judges') layout: ``critic.parallel``, else the actor's."""
    return cfg.critic.parallel or cfg.actor.parallel


def scoring_temperature(temperature: float) -> float:
    """The temperature log-probs are scored at: the sampling one, except that 0 (greedy
    decoding) scores the plain distribution."""
    return temperature if temperature > 0 else 1.0


def check_layout(cfg: PPOConfig, world: int, dp: int, generates: bool = True) -> None:
    """Batch arithmetic once the data-parallel size is known; ``generates``: the group hosts
    rollout engines (a separate critic group does not)."""
    a, r = cfg.actor, cfg.rollout
    engines = r.world_size if r.placement == "separate" else world  # the ranks engines cover
    if generates and engines % r.tp:
        raise UserError(f"config: rollout.tp={r.tp} does not divide the {engines} worker ranks")
    if generates:
        per_node = min(engines, cfg.trainer.n_gpus_per_node)
        check_engine_layout(r.tp, per_node, -(-engines // per_node))
    per_rank = a.ppo_mini_batch_size // dp if a.ppo_mini_batch_size % dp == 0 else None
    if per_rank is None or per_rank % a.ppo_micro_batch_size_per_rank:
        raise UserError(f"config: actor.ppo_mini_batch_size={a.ppo_mini_batch_size} must split into "
                        f"{dp} data-parallel ranks x micro-batches of "
                        f"actor.ppo_micro_batch_size_per_rank={a.ppo_micro_batch_size_per_rank}")


def _check_recipes(cfg: PPOConfig) -> None:
    """DAPO's dynamic sampling and overlong shaping, GSPO, rollout correction."""
    alg, f, c = cfg.algorithm, cfg.algorithm.filter_groups, cfg.algorithm.rollout_correction
    _choice("actor.policy_loss", cfg.actor.policy_loss, POLICY_LOSSES)
    if (estimator(alg.adv_estimator).policy_loss == "sppo") != (cfg.actor.policy_loss == "sppo"):
        raise UserError(f"config: SPPO is algorithm.adv_estimator=sppo with actor.policy_loss=sppo "
                        f"(got {alg.adv_estimator} and {cfg.actor.policy_loss})")
    if alg.adv_estimator == "sppo":
        _choice("algorithm.sppo_target", alg.sppo_target, TARGETS)
        _choice("algorithm.sppo_softmean_scope", alg.sppo_softmean_scope, ("prompt", "batch"))
        _choice("algorithm.sppo_preference", alg.sppo_preference, ("auto", *PREFERENCES))
        if not cfg.actor.loss_agg_mode.startswith("seq-mean-token-"):
            raise UserError(f"config: SPPO's loss is one term per sequence; actor.loss_agg_mode="
                            f"{cfg.actor.loss_agg_mode} must be a seq-mean-* mode")
    _check_rollout_correction(cfg)
    if f.enable:
        _choice("algorithm.filter_groups.metric", f.metric, ("score", "oracle"))
        if alg.adv_estimator not in GROUP_ESTIMATORS:
            raise UserError(f"config: algorithm.filter_groups drops groups without signal under "
                            f"a group baseline; algorithm.adv_estimator={alg.adv_estimator} has "
                            f"none (use one of {', '.join(GROUP_ESTIMATORS)})")
        if cfg.rollout.max_turns > 1:
            raise UserError("config: algorithm.filter_groups works on single-turn rollouts "
                            f"(rollout.max_turns={cfg.rollout.max_turns})")
        if f.metric == "oracle" and not (cfg.reward.oracle_fn or cfg.reward.fn):
            raise UserError("config: algorithm.filter_groups.metric=oracle needs reward.fn "
                            "or reward.oracle_fn")
        check_positive("algorithm.filter_groups.max_rounds", f.max_rounds)
        if not f.oversample >= 1:
            raise UserError(f"config: algorithm.filter_groups.oversample={f.oversample} must "
                            "be >= 1")
    d = cfg.data
    if not 0 <= d.offline_fraction <= 1:
        raise UserError(f"config: data.offline_fraction={d.offline_fraction} must be in [0, 1]")
    if d.offline_fraction > 0:
        if not d.offline_files:
            raise UserError(f"config: data.offline_fraction={d.offline_fraction} needs "
                            "data.offline_files")
        if c.mode == "none":
            raise UserError("config: data.offline_files are off-policy samples; set "
                            "algorithm.rollout_correction.mode (tis, mask or tis+mask)")
        if f.enable or cfg.rollout.max_turns > 1:
            raise UserError("config: data.offline_files work with single-turn rollouts without "
                            "algorithm.filter_groups")
    o = cfg.reward.overlong_buffer
    if o.enable and not 0 < o.len <= cfg.data.max_response_length:
        raise UserError(f"config: reward.overlong_buffer.len={o.len} must be in "
                        f"(0, data.max_response_length={cfg.data.max_response_length}]")


def _check_rollout_correction(cfg: PPOConfig) -> None:
    """``algorithm.rollout_correction``: names, bounds, and the bypass's loss, which it resolves
    into ``actor.policy_loss`` (the loss the workers compute)."""
    c, key = cfg.algorithm.rollout_correction, "algorithm.rollout_correction"
    _choice(f"{key}.mode", c.mode, ("none", "tis", "mask", "tis+mask"))
    if c.mask_level == "seq_max_k1":
        raise UserError(f"config: {key}.mask_level=seq_max_k1 is not a rejection verl 0.9.1 has "
                        "(the largest signed log-ratio bounds one side only); use seq_max_k2 or "
                        "seq_max_k3, or token_k1 for a band on every token")
    _choice(f"{key}.mask_level", c.mask_level, MASK_LEVELS)
    _choice(f"{key}.tis_level", c.tis_level, TIS_LEVELS)
    _choice(f"{key}.bypass_loss", c.bypass_loss, ("ppo_clip", "reinforce"))
    if c.bypass and c.mode != "none":
        raise UserError(f"config: {key}.bypass takes the engine's log-probs as the old ones, "
                        f"leaving no gap for mode={c.mode} to correct; set one of them")
    if c.mode != "none":
        if not c.tis_cap > 0:
            raise UserError(f"config: {key}.tis_cap={c.tis_cap} must be > 0 (the largest "
                            "importance weight)")
        if not 0 <= c.tis_low < 1:
            raise UserError(f"config: {key}.tis_low={c.tis_low} must be in [0, 1) (0: TIS, "
                            "weights capped; else the bottom of IcePop's band)")
        if c.tis_low > 0 and not c.tis_low < c.tis_cap:
            raise UserError(f"config: {key}.tis_low={c.tis_low} must be below "
                            f"tis_cap={c.tis_cap} (IcePop keeps weights in [tis_low, tis_cap])")
        if not 0 < c.mask_low < 1 < c.mask_high:
            raise UserError(f"config: {key} needs 0 < mask_low < 1 < mask_high, a band of "
                            f"ratios around 1 (got mask_low={c.mask_low}, "
                            f"mask_high={c.mask_high})")
        if not c.mask_divergence_max > 0:
            raise UserError(f"config: {key}.mask_divergence_max={c.mask_divergence_max} must be "
                            "> 0 (nats: the largest k2/k3 statistic kept)")
    _resolve_bypass_loss(cfg)


def _resolve_bypass_loss(cfg: PPOConfig) -> None:
    c, loss = cfg.algorithm.rollout_correction, cfg.actor.policy_loss
    if c.bypass_loss == "reinforce":
        if not c.bypass:
            raise UserError("config: algorithm.rollout_correction.bypass_loss=reinforce is the "
                            "bypass's loss; set algorithm.rollout_correction.bypass=true")
        if loss not in ("vanilla", "reinforce"):
            raise UserError(f"config: algorithm.rollout_correction.bypass_loss=reinforce replaces "
                            f"actor.policy_loss; leave it at vanilla (got {loss})")
        cfg.actor.policy_loss = "reinforce"  # the workers' loss; validating twice changes nothing
    elif loss == "reinforce":
        raise UserError("config: actor.policy_loss=reinforce is set by "
                        "algorithm.rollout_correction.bypass=true bypass_loss=reinforce; use those")


def _check_reward(cfg: PPOConfig) -> None:
    """Pool settings, the format regex, and every named reward function resolves (imports it:
    a missing module or function stops the run here, naming the key)."""
    import re

    from megatron_rlhf.rewards.registry import RewardOptions, resolve

    rw = cfg.reward
    check_positive("reward.timeout_s", rw.timeout_s)
    if rw.workers is not None and rw.workers < 0:
        raise UserError(f"config: reward.workers={rw.workers} must be >= 0 (0: in the driver "
                        "process)")
    try:
        re.compile(rw.format_pattern)
    except re.error as err:
        raise UserError(f"config: reward.format_pattern={rw.format_pattern!r} is not a valid "
                        f"regex ({err})") from None
    options = RewardOptions(format_pattern=rw.format_pattern)
    for key, spec in (("reward.fn", rw.fn), ("reward.oracle_fn", rw.oracle_fn)):
        if spec is not None:
            resolve(spec, key, options)
