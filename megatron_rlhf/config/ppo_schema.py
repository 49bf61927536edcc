"""The PPO config tree (``megatron-rlhf ppo``). Names follow verl where verl has one, so a verl
user's overrides (``actor.ppo_epochs=2``, ``algorithm.kl_ctrl.type=adaptive``) read the same.

Batch units: ``data.train_batch_size`` counts prompts (global); with ``rollout.n`` samples per
prompt one step holds ``train_batch_size * n`` samples. Mini- and micro-batch sizes count samples:
``ppo_mini_batch_size`` is global, ``ppo_micro_batch_size_per_rank`` is per data-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_rlhf.config.schema import (LoRAConfig, MoEConfig, OptimConfig, ParallelConfig,
                                         ToolConfig, TrainerConfig)


@dataclass
class PPODataConfig:
    train_files: list[str] = field(default_factory=list)
    """Prompt Parquet files: a ``prompt`` column (string or chat messages) and optionally the
    rule-based checker's ``ground_truth`` column."""
    val_files: list[str] = field(default_factory=list)
    """Held-out prompts, same layout; validated greedily every ``trainer.eval_every_steps``."""
    prompt_key: str = "prompt"
    """Column of the prompt (a string, or chat messages rendered by the tokenizer's chat template)."""
    ground_truth_key: str = "ground_truth"
    """Column of the answer the rule-based checker (``reward.fn``) compares with."""
    max_prompt_length: int = 512
    """Longest prompt in tokens after the chat template; longer prompts follow ``overlong``."""
    max_response_length: int = 512
    """Tokens generated at most per sample."""
    overlong: str = "drop"
    """Prompts over ``max_prompt_length``: ``drop`` or ``truncate`` (keep the end)."""
    train_batch_size: int = 64
    """Prompts per PPO step, global."""
    use_remove_padding: bool = True
    """Pack each micro-batch's samples into rows of ``max_prompt_length + max_response_length``
    tokens (block-diagonal attention) instead of padding every sample to the longest."""
    share_prompts: Optional[bool] = None
    """In packed micro-batches the samples of one prompt (a group of ``rollout.n``) share it:
    the prompt once, then each reply, attending to the prompt and to itself, at the positions
    it has after the prompt; its forward and backward are computed once (exactly: the
    gradients that reach it add up as over copies). Unset: on wherever rows are packed
    (``use_remove_padding``, megatron's own attention); ``true`` where it cannot apply is an
    error; ``false``: a copy of the prompt per sample."""
    shuffle: bool = True
    """Shuffle the prompts each epoch (seeded by ``trainer.seed`` and the epoch)."""
    offline_files: list[str] = field(default_factory=list)
    """Parquet of responses to train on without generating them (``megatron_rlhf.data.offline``):
    ``prompt`` + ``response`` (+ ``behaviour_logprobs`` per token, + the ground truth), or the
    preference format ``prompt`` + ``chosen`` + ``rejected``."""
    offline_fraction: float = 0.0
    """Share of each step's prompts (``data.train_batch_size``) whose samples come from
    ``offline_files`` instead of the rollout engine; 1.0: offline only. Needs
    ``algorithm.rollout_correction`` (the samples are off-policy)."""


@dataclass
class KLControlConfig:
    type: str = "fixed"
    """``fixed`` or ``adaptive`` (Ziegler et al. 2019: move the coefficient toward ``target_kl``)."""
    kl_coef: float = 0.001
    """Initial coefficient of the KL penalty in the reward."""
    target_kl: float = 0.1
    """Adaptive only: the KL the controller aims for, per token (each response's mean, averaged
    over responses, as verl). Only with ``use_kl_in_reward``; the KL loss has its own fixed
    ``actor.kl_loss_coef``."""
    horizon: int = 10000
    """Adaptive only: samples over which the coefficient adapts."""


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling: groups whose scores are all equal carry no signal under a group
    baseline; they are dropped and further rounds of fresh prompts are generated until the step
    holds ``data.train_batch_size`` groups with signal."""

    enable: bool = False
    """Turn dynamic sampling on (``algorithm.filter_groups``)."""
    metric: str = "score"
    """What must differ within a group: ``score`` (the training score) or ``oracle``."""
    max_rounds: int = 4
    """Generation rounds per step at most (the first included). When they run out the step
    trains on the groups it has; the other rows are masked out of the loss and logged."""
    oversample: float = 1.5
    """Each further round draws ``ceil(oversample * missing groups)`` fresh prompts."""


@dataclass
class RolloutCorrectionConfig:
    """Correction for the gap between the rollout engine's and the trainer's probabilities of
    the sampled tokens (``megatron_rlhf.algorithms.rollout_correction``: verl 0.9.1's toolbox,
    with ``r = pi_old / pi_rollout`` per token). Logged every step a correction is on:
    ``mismatch/kl_k1``, ``mismatch/kl_k3``, ``mismatch/ppl_ratio``, ``mismatch/logprob_diff_mean``;
    with IS ``is/weight_mean``, ``is/weight_max``, ``is/capped_fraction``, ``is/zeroed_fraction``
    (``is/batch_norm_factor``); with rejection ``rs/rejected_fraction``."""

    mode: str = "auto"
    """``auto``: ``tis`` when rollouts may be stale (``rollout.max_staleness > 0``), else
    ``none``; ``none``; ``tis``: weight every token's loss by an importance weight (``tis_*``);
    ``mask``: rejection sampling, leave tokens or samples out of the loss (``mask_*``);
    ``tis+mask``: both."""
    tis_cap: float = 2.0
    """Largest importance weight (a ratio, unitless): TIS caps weights at it (verl's
    ``rollout_is_threshold``); with ``tis_low > 0`` it is the top of IcePop's band instead."""
    tis_level: str = "token"
    """``token``: each token's own ratio; ``sequence``: its sequence's (product over tokens, on
    every token of it); ``geometric``: the sequence's geometric mean ratio (length-independent)."""
    tis_low: float = 0.0
    """0: truncated IS (weights capped at ``tis_cap``). In (0, 1): IcePop: weights outside
    ``[tis_low, tis_cap]`` are set to zero instead of capped, their tokens still counted in the
    loss's denominator (verl's ``rollout_is_threshold="tis_low_tis_cap"``)."""
    tis_batch_normalize: bool = False
    """Divide the step's weights by their mean over its response tokens (``token``) or over its
    non-empty samples (``sequence``, ``geometric``), so they average 1 (verl's
    ``rollout_is_batch_normalize``)."""
    bypass: bool = False
    """Use the rollout engine's log-probs of the sampled tokens as the old log-probs: the
    trainer's old-log-prob pass is skipped (the update's ratio is against the engine). For an
    engine that agrees with the trainer (``rollout/logprob_diff_max`` near 0); excludes ``mode``
    (verl's ``bypass_mode``)."""
    bypass_loss: str = "ppo_clip"
    """The loss with ``bypass``: ``ppo_clip`` (``actor.policy_loss``, the ratio taken against the
    engine) or ``reinforce`` (``-A * log pi`` per token, no ratio and no clip; verl's
    ``loss_type=reinforce``). ``reinforce`` sets ``actor.policy_loss=reinforce``, which must be
    left at ``vanilla``."""
    mask_low: float = 0.5
    """``*_k1`` rejection: lowest ratio kept (``r``, or the sequence's product or geometric
    mean), in (0, 1). verl bounds ``1 / r``: our ``[mask_low, mask_high]`` is its
    ``rollout_rs_threshold="1/mask_high_1/mask_low"``."""
    mask_high: float = 2.0
    """``*_k1`` rejection: highest ratio kept, above 1."""
    mask_level: str = "geometric"
    """Rejection statistic (verl's ``rollout_rs``). Tokens: ``token_k1`` (``r`` in
    ``[mask_low, mask_high]``), ``token_k2`` (``(log r)^2 / 2``), ``token_k3`` (``r - 1 - log r``)
    at most ``mask_divergence_max``: only those tokens leave the loss. Whole samples:
    ``seq_sum_k1..k3`` (sum over the response's tokens), ``seq_mean_k1..k3`` (mean),
    ``seq_max_k2``, ``seq_max_k3`` (max). ``geometric`` is ``seq_mean_k1`` (the geometric mean
    ratio), ``sequence`` is ``seq_sum_k1`` (the product)."""
    mask_divergence_max: float = 0.01
    """``*_k2`` and ``*_k3`` rejection: largest statistic kept, in nats (verl's
    ``rollout_rs_threshold`` for them; its K3 presets use 0.01)."""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"
    """``gae`` (needs the critic); ``grpo``, ``rloo`` or ``reinforce_plus_plus_baseline`` (group
    baselines, no critic); ``reinforce_plus_plus`` (the batch is the baseline, no critic);
    ``sppo`` (self-play preference optimisation, with ``actor.policy_loss=sppo``)."""
    sppo_target: str = "win_rate"
    """SPPO's regression target: ``win_rate`` (``P(y > pi) - 1/2`` from the group's pairwise
    preferences) or ``softmean`` (``r - softmean_beta(r)`` over ``sppo_softmean_scope``)."""
    sppo_preference: str = "auto"
    """How SPPO turns scores into ``P(y_i > y_j)``: ``bradley_terry`` (``sigmoid(r_i - r_j)``,
    for a reward model's scores), ``rule`` (win 1, tie 1/2, loss 0), or ``auto`` (Bradley-Terry
    when ``reward.model_path`` is set, else rule)."""
    sppo_beta: float = 1.0
    """``softmean`` target's temperature (0: the plain mean)."""
    sppo_softmean_scope: str = "prompt"
    """What ``softmean`` averages over: ``prompt`` (the samples of each response's own prompt)
    or ``batch`` (every sample of the step, as verl's SPPO recipe does)."""
    gamma: float = 0.99
    """Discount per token."""
    lam: float = 0.95
    """GAE lambda."""
    whiten_advantages: bool = True
    """Normalise advantages over the step's response tokens (GAE only)."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO divides each centred score by its group's std; ``false``: centring only (Dr. GRPO)."""
    use_kl_in_reward: bool = False
    """Subtract ``kl_coef * KL_t`` from every response token's reward."""
    kl_penalty: str = "k1"
    """Estimator for the in-reward KL: k1, abs, k2/mse, k3/low_var_kl."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    ref_log_prob: str = "auto"
    """``auto``: reference log-probs (and the reference model) only when a KL term
    (``use_kl_in_reward``, ``actor.use_kl_loss``) or the KL rollback guard needs them;
    ``always``: also to monitor ``actor/kl`` when nothing uses it."""


@dataclass
class OffloadConfig:
    """What of a colocated model goes to host memory while it is not needed (verl's
    ``param_offload`` / ``grad_offload`` / ``optimizer_offload``): its device storage is freed
    while the rollout engine generates and between the phases that use it; each phase brings
    back only what it needs (log-prob and value passes the parameters, the update all three,
    the weight sync the parameters)."""

    params: bool = False
    """The weights (megatron DDP's contiguous parameter buffer, or a frozen model's tensors)."""
    grads: bool = False
    """The gradient buffer (trainable models only)."""
    optimizer: bool = False
    """The optimizer's fp32 main weights and Adam moments (trainable models only)."""


@dataclass
class ActorConfig:
    model_path: str = ""
    """Policy to start from: HF ``*ForCausalLM`` folder or a megatron_rlhf checkpoint (e.g. SFT's).
    The reference model is the same weights, frozen. Required unless ``agents`` is set."""
    ref_model_path: Optional[str] = None
    """The frozen reference (KL terms): default ``model_path``, the policy's own start."""
    dtype: str = "auto"
    """Parameter dtype of the actor and reference: ``auto`` (float32 on CPU, bfloat16 on GPU), float32, bfloat16."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-experts training settings (also used by the reference model's layout)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6, warmup_steps_ratio=0.0))
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters on the policy (``rank`` 0: off): only the adapters train; the reference
    policy is the frozen base itself (adapters switched off, no second model: ``ref_model_path``
    and ``ref_offload`` are refused); the rollout engine receives the merged weights
    ``W + alpha/rank B A``. Give the adapters about 10x the full fine-tuning ``optim.lr``."""
    ppo_mini_batch_size: int = 64
    """Samples per optimizer step, global."""
    ppo_micro_batch_size_per_rank: int = 16
    """Samples per forward/backward on one data-parallel rank."""
    ppo_micro_batch_tokens_per_rank: int = 0
    """With ``data.use_remove_padding``: tokens per forward/backward on one data-parallel rank
    instead (verl's ``use_dynamic_bsz`` with ``ppo_max_token_len_per_gpu``): each rank's samples
    are grouped first-fit, longest first, into micro-batches of at most this many tokens however
    many samples that holds, each packed into rows of ``max_prompt + max_response`` tokens.
    0: ``ppo_micro_batch_size_per_rank`` samples each.
    Applies to the actor, reference, critic and reward passes alike."""
    ppo_epochs: int = 4
    """Passes over each step's samples."""
    logprob_chunk_tokens: int = 1024
    """Log-probs and entropy (update, old and reference passes) come from the last hidden states
    at response positions only, through the output layer this many tokens at a time: no
    ``[tokens x vocab]`` logits are kept. 0: full logits on every position (the older path)."""
    clip_ratio: float = 0.2
    """PPO's clip range of the ratio, both sides unless ``clip_ratio_low``/``clip_ratio_high`` are set."""
    clip_ratio_low: Optional[float] = None
    """Lower clip (defaults to ``clip_ratio``); DAPO's clip-higher sets ``clip_ratio_high`` apart."""
    clip_ratio_high: Optional[float] = None
    """Upper clip (defaults to ``clip_ratio``)."""
    clip_ratio_c: float = 3.0
    """Dual-clip constant for negative advantages (> 1; 0 disables)."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus in the actor loss (0: off)."""
    loss_agg_mode: str = "token-mean"
    """token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm
    (per-sequence sums over ``data.max_response_length``, Dr. GRPO)."""
    sppo_eta: float = 1.0
    """SPPO's step size: the sequence log-ratio is regressed onto ``sppo_eta`` times the target."""
    policy_loss: str = "vanilla"
    """``vanilla`` (PPO's per-token ratio), ``gspo`` (one length-normalised ratio per sequence;
    its clip range defaults to 3e-4 / 4e-4 unless ``clip_ratio_low/high`` are set) or ``sppo``
    (squared gap between the sequence log-ratio and ``sppo_eta`` x the target; with
    ``algorithm.adv_estimator=sppo``)."""
    overlong_filter: bool = False
    """Leave samples cut at ``data.max_response_length`` out of the loss (DAPO)."""
    use_kl_loss: bool = False
    """Add ``kl_loss_coef * KL(actor || reference)`` to the actor loss (GRPO style)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss (``use_kl_loss``), per token."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator of the KL loss: ``k1``, ``abs``, ``k2`` (= ``mse``) or ``k3`` (= ``low_var_kl``)."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """The actor's state in host memory while the engine generates (colocated engines)."""
    ref_offload: OffloadConfig = field(default_factory=OffloadConfig)
    """The reference model's weights in host memory outside its log-prob pass (``params`` only)."""
    router_replay: str = "none"
    """MoE routing replay on megatron-core's ``RouterReplay``: ``none``; ``R3`` (the rollout
    engine's own top-k experts of every token and MoE layer, recorded while it generated, are
    replayed in the old, reference and update passes: arXiv 2510.11370); ``R2`` (the old-policy
    pass's routing, recorded, is replayed in the update's epochs). The router's probabilities
    still come from the trainer's scores, so the router keeps its gradient."""


@dataclass
class CriticConfig:
    model_path: Optional[str] = None
    """Value model: HF LM / classifier / reward-model checkpoint; default the actor's start."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5, warmup_steps_ratio=0.0))
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters on the value model (``rank`` 0: off): the adapters and the value head
    train, the rest is frozen."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-experts settings of the critic (and the reward model in its group)."""
    cliprange_value: float = 0.5
    """Clip of the new value around the old one, in reward units (0 disables)."""
    ppo_epochs: Optional[int] = None
    """Defaults to ``actor.ppo_epochs``."""
    parallel: Optional[ParallelConfig] = None
    """Only with ``resource_pool.critic=separate``; otherwise the actor's layout."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """The critic's state in host memory outside its value pass and update."""


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment, added to the score: 0 up to ``max_response_length - len``
    tokens, then linearly down to ``-penalty_factor`` at ``max_response_length``."""

    enable: bool = False
    """Add the overlong penalty to the score."""
    len: int = 16
    """Tokens before ``max_response_length`` where the penalty starts."""
    penalty_factor: float = 1.0
    """The penalty at ``max_response_length`` (reward units)."""


@dataclass
class RewardConfig:
    model_path: Optional[str] = None
    """Bradley-Terry reward model checkpoint from ``train-rm`` (or an HF classifier)."""
    fn: Optional[str] = None
    """Rule-based reward: a built-in (``addition``, ``math``, ``format``),
    ``reasoning_gym:<task>`` (that task's own scorer) or ``package.module:function``; called as
    ``fn(response, ground_truth, prompt, extra)`` or ``fn(response, ground_truth)``, returning a
    float or a dict with ``score`` and extras logged as ``reward/<name>``
    (``megatron_rlhf.rewards.registry`` documents the arguments). It also gives
    ``reward/oracle_mean`` unless ``oracle_fn`` is set."""
    rm_weight: float = 1.0
    """Weight of the reward model's score in the training score."""
    fn_weight: float = 1.0
    """The score is ``rm_weight * rm + fn_weight * fn`` over the configured sources."""
    oracle_fn: Optional[str] = None
    """A checker only measured (``reward/oracle_mean``, validation accuracy), never trained on;
    named like ``fn``."""
    format_pattern: str = r"<think>.*?</think>\s*<answer>.*?</answer>"
    """The ``format`` reward's Python regex: 1.0 when it matches the whole stripped response
    (``.`` matches newlines too)."""
    workers: Optional[int] = None
    """Processes that run the reward functions (on the driver's machine), each call limited to
    ``timeout_s``; 0: in the driver process, no timeout enforced. Unset: 0 when every function
    is ``addition`` (cheap, cannot hang), else min(4, CPUs)."""
    timeout_s: float = 10.0
    """Seconds one call may take in a worker; a call over it, or one that raises, scores 0 and
    is counted (``reward/timeouts``, ``reward/errors``) and named in the log."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """The reward model's weights in host memory outside its scoring pass (``params`` only)."""


@dataclass
class RolloutConfig:
    backend: str = "hf"
    """``hf`` (transformers generation with KV cache, CPU or GPU) or ``sglang`` (GPU)."""
    dtype: str = "auto"
    """The engine's weights and compute: ``auto`` (the actor's ``actor.dtype``), ``float32``,
    ``bfloat16`` or ``float16``; the weight sync casts. A bf16 engine fed by an fp32 trainer is
    the train-inference mismatch ``algorithm.rollout_correction`` corrects."""
    tp: int = 1
    """GPUs (ranks) per rollout engine: a divisor of a node's GPUs or whole nodes (an engine over
    several nodes runs one process a node). Engines are the generator's data parallelism:
    world / tp of them."""
    placement: str = "colocated"
    """``colocated``: engines on the trainer's GPUs (their memory released while it trains);
    ``separate``: engines on ``world_size`` ranks of their own, fed over a broadcast bridge."""
    world_size: int = 1
    """Ranks of the separate rollout group (``placement=separate``); engines of ``tp`` each."""
    max_staleness: int = 0
    """0: on-policy (generation waits for the latest weights). k > 0 (``placement=separate``):
    the rollout group generates the batches of the next k steps while the trainers update,
    each with the weights it held then, so a batch is trained on up to k updates after the
    weights that sampled it (``rollout/staleness``); the gap is corrected by
    ``algorithm.rollout_correction`` (``auto``: token TIS against the trainer's recomputed
    log-probs, the proximal policy of AReaL's decoupled objective)."""
    ep: int = 1
    """MoE models: experts split over this many of an engine's ``tp`` GPUs (SGLang's
    ``ep_size``; the ``hf`` engine takes 1 or ``tp``). DP-attention and the other SGLang MoE
    settings go in ``engine_args``."""
    n: int = 1
    """Samples per prompt (GRPO/RLOO need > 1)."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts (0: greedy); the trainer scores at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling of training rollouts (1.0: off)."""
    top_k: int = 0
    """0 or -1 disables."""
    stop: list[str] = field(default_factory=list)
    """Extra stop strings (each must be one token); EOS always stops."""
    seed: int = 0
    """Sampling seed, combined with the step and the generator rank."""
    max_turns: int = 1
    """> 1: multi-turn rollouts. After a turn that ``reward.fn`` scores below 1 (and that ended
    with a stop token), the environment answers ``retry_feedback`` as a user turn and the policy
    tries again, up to this many turns; each turn's reward lands on its last token."""
    retry_feedback: str = "That is not right. Try again."
    """The user turn the environment answers a wrong turn with (``max_turns > 1``)."""
    bucket_size_mb: float = 512.0
    """Weight-sync bucket: at most this many MiB of weights in flight per rank."""
    gpu_memory_utilization: float = 0.4
    """SGLang's static memory (weights + KV cache) per GPU, as a fraction of the GPU."""
    deterministic: bool = False
    """SGLang's deterministic inference (batch-invariant kernels: a sample's tokens depend on
    its seed, not on what else is in the batch; slower). Every sample has a seed of its own
    (the replica's seed and its index), so a group's samples still differ."""
    engine_args: dict[str, Any] = field(default_factory=dict)
    """Further SGLang engine arguments by SGLang's own names (``{enable_dp_attention: true,
    dp_size: 8}``), checked at start-up against the names the pinned SGLang
    knows; the ones the config sets (tp, memory, seed, deterministic) are not taken here."""
    val_temperature: float = 0.0
    """Validation sampling temperature (0: greedy)."""
    tools: list[ToolConfig] = field(default_factory=list)
    """Tools the policy may call (docs/tools.md); their schemas reach the model through the chat
    template's ``tools=``. Empty (and no ``tools_file``): no tools."""
    tools_file: Optional[str] = None
    """A YAML file with a list of tools (entries as in ``tools``), added after ``tools``."""
    tool_call_format: str = "auto"
    """How calls are written: ``hermes`` (``<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>``, Qwen), ``llama3`` (``{"name": ..., "parameters": {...}}``), ``auto``: the
    one the chat template teaches."""
    max_assistant_turns: int = 4
    """With tools: assistant turns per sample at most, each turn's calls answered before the next
    (the last turn's calls stay unanswered, ``tools/unanswered``). The whole trajectory, tool
    tokens included, fits ``data.max_response_length``."""
    sandbox: str = "require"
    """The ``python`` tool's isolation: ``require`` (bubblewrap namespaces and resource limits; a
    start-up error if bwrap cannot run) or ``best_effort`` (resource limits only when it cannot,
    said in one line at start-up)."""
    tool_check: bool = False
    """Render each finished conversation with the chat template and compare its tokens with the
    trajectory's (``tools/template_mismatch``: the samples that differ; a tokenisation per
    sample). A policy's own non-canonical tokenisation of its text counts too."""
    tool_workers: int = 4
    """Processes answering user-function tools, and sandboxed ``python`` calls at once."""


@dataclass
class RollbackConfig:
    kl_threshold: float = 0.0
    """Roll back when mean KL(actor || reference) per token exceeds this (0: off). NaN/inf losses
    always roll back when a checkpoint exists. A rollback restores the newest checkpoint; the
    same step failing again goes one restore point further back each time (the newer ones are
    deleted), so keep ``trainer.keep_last_n`` >= 2 for the guard to have somewhere to go."""
    lr_factor: float = 0.5
    """Actor (and critic) learning rate is multiplied by this on each rollback."""
    kl_coef_factor: float = 2.0
    """KL coefficient (in-reward and loss) is multiplied by this on each rollback."""
    max_rollbacks: int = 3
    """Stop the run after this many rollbacks."""


@dataclass
class PPOTrainerConfig(TrainerConfig):
    output_dir: str = "runs/ppo"
    n_gpus_per_node: int = 1
    """Worker processes per node (one per GPU; on CPU one per process you give it)."""
    nnodes: int = 1
    """Nodes of the job (Slurm: the allocation's)."""
    rollback: RollbackConfig = field(default_factory=RollbackConfig)
    critic_warmup: int = 0
    """Steps at the start (of a fresh run) that update only the critic, so the first policy
    updates see a value baseline that has already fit the reward's scale."""
    val_before_train: bool = True
    """Validate the starting policy, so the first and last validation rows compare."""
    rollout_data_dir: Optional[str] = None
    """Write every step's samples here (``step_<n>.jsonl``, one line a sample: prompt and
    response token ids, the engine's log-probs, the score, the weight version that sampled it),
    as verl's option of the same name; relative paths are under ``output_dir``."""


@dataclass
class RayConfig:
    address: Optional[str] = None
    """Join this cluster (``auto`` or ``host:port``; else ``$RAY_ADDRESS``, as ``ray job submit``
    sets it); default: start a local one for this run, never the newest one on the host."""
    num_cpus: Optional[int] = None
    """Logical CPUs of a local cluster (default: one per worker plus one)."""
    object_store_mb: int = 256
    """Object store of a local cluster."""


@dataclass
class ResourcePoolConfig:
    critic: str = "shared"
    """``shared``: critic and reward model live in the actor's workers (time-shared);
    ``separate``: their own worker group of ``critic_world_size`` processes."""
    critic_world_size: int = 1
    """Ranks of the separate critic group (``critic=separate``)."""


@dataclass
class AgentConfig:
    """One actor of a multi-agent run (``agents:``); unset fields default to ``actor.*``."""

    name: str = "???"
    """Unique; names the agent's checkpoints (``agents/<name>/``) and metrics (``agent/<name>/``)."""
    model_path: str = "???"
    """Where this agent starts (HF folder or megatron_rlhf checkpoint)."""
    reference_path: Optional[str] = None
    """This agent's frozen reference: default ``actor.ref_model_path``, else its own start
    (give every agent the same path to share one reference policy)."""
    reward_model_path: Optional[str] = None
    """This agent's reward model: default ``reward.model_path``. Agents whose paths are equal
    share one judge group; each distinct path gets a group of its own
    (``multi_agent.judge_world_size`` ranks). ``population`` needs one for all (one table)."""
    optim: dict[str, Any] = field(default_factory=dict)
    """Fields of ``actor.optim`` this agent changes (``{lr: 1e-5}``); the rest are ``actor.optim``'s."""
    parallel: dict[str, Any] = field(default_factory=dict)
    """Fields of ``actor.parallel`` this agent changes; resolved over ``world_size`` ranks."""
    world_size: int = 1
    """Worker ranks (one per GPU) of this agent's group."""
    resource_pool: str = "shared"
    """Agents naming the same pool share its devices (each rank takes a fraction of one);
    ``separate``: a pool of its own."""
    temperature: Optional[float] = None
    """Rollout temperature; default ``rollout.temperature``."""


@dataclass
class MultiAgentConfig:
    """How the agents of ``agents:`` play (``megatron_rlhf.trainers.rl.modes``)."""

    mode: str = "solo"
    """``solo``: each agent rolls out and is scored on its own, as one PPO run (one agent: exactly
    the plain run; several: trained side by side on shared pools and judges); ``population``:
    every agent answers every prompt, each regresses onto its win rate
    against the whole population (SPPO); ``proposer-solver``: one agent writes tasks, the other
    solves them; ``critique-revise``: one answers, the other critiques, the first revises."""
    judge_world_size: int = 1
    """Ranks of each judge group: the group that hosts a reward model (``reward.model_path``,
    or an agent's own ``reward_model_path``) and scores the samples of the agents using it."""
    proposer: Optional[str] = None
    """proposer-solver: the agent that writes tasks (default the first); the other solves."""
    proposer_prompt: str = "Write a question."
    """proposer-solver: the instruction the proposer answers with a task."""
    task: str = "addition"
    """proposer-solver's task family: what a proposal must parse as, and its checker."""
    task_high: int = 19
    """addition: the largest operand a valid proposal may use (the bundled task's default)."""
    answerer: Optional[str] = None
    """critique-revise: the agent that answers and revises (default the first)."""
    critique_prompt: str = " Check this answer."
    """critique-revise: appended after the answer for the critic."""
    revise_prompt: str = " Final answer:"
    """critique-revise: appended after the critique for the answerer's revision."""


@dataclass
class PPOConfig:
    """``megatron-rlhf ppo``: PPO/GRPO from a policy and a reward (model and/or rule)."""

    data: PPODataConfig = field(default_factory=PPODataConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: PPOTrainerConfig = field(default_factory=PPOTrainerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    resource_pool: ResourcePoolConfig = field(default_factory=ResourcePoolConfig)
    agents: list[AgentConfig] = field(default_factory=list)
    """Two or more actors trained together (``multi_agent``); empty: one actor (``actor``)."""
    multi_agent: MultiAgentConfig = field(default_factory=MultiAgentConfig)
