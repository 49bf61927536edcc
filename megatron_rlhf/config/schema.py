"""The typed config tree (dataclasses). Every field says its unit and scope.

YAML files under ``configs/`` and ``key=value`` overrides are merged onto these defaults by
:mod:`megatron_rlhf.config.loader`, which also validates the result once, at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_rlhf.errors import UserError


@dataclass
class MoEConfig:
    """Training settings of mixture-of-experts models (ignored by dense ones)."""

    aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss added to the objective (0: off)."""
    load_balancing: str = "aux_loss"
    """``aux_loss`` (over the micro-batch's tokens) or ``seq_aux_loss`` (per sequence)."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss, ``mean(logsumexp(router logits)^2)`` (0: off)."""
    expert_bias_update_rate: float = 1e-3
    """Routers with an expert bias (DeepSeek-V3): bias step toward balance per optimizer step."""
    token_dispatcher: str = "alltoall"
    """How tokens reach their experts across expert-parallel ranks: ``alltoall`` or ``allgather``."""


@dataclass
class LoRAConfig:
    """Low-rank adapters on the model's linears: each targeted ``y = W x`` becomes
    ``W x + (alpha / rank) * B A dropout(x)``, ``A`` ``[rank, in]``, ``B`` ``[out, rank]`` (zero at
    the start), with ``W`` frozen: only adapters (and a value head) train."""

    rank: int = 0
    """Adapter rank ``r``; 0: no adapters, the whole model trains."""
    alpha: float = 16.0
    """Scale numerator: the adapter's term is multiplied by ``alpha / rank``."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training, in [0, 1)."""
    target_modules: list[str] = field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    """megatron-core names of the linears to adapt: ``linear_qkv`` (fused q/k/v), ``linear_proj``
    (attention output), ``linear_fc1`` (fused gate/up), ``linear_fc2`` (down); in MoE layers
    ``linear_fc1``/``linear_fc2`` also name the shared and routed experts' (routed experts: with
    ``etp`` 1); multi-latent attention models (DeepSeek-V3) name theirs ``linear_q_proj`` or
    ``linear_q_down_proj``/``linear_q_up_proj``, ``linear_kv_down_proj``, ``linear_kv_up_proj``
    and ``linear_proj`` (they have no ``linear_qkv``)."""
    init: str = "kaiming"
    """``A``'s initialisation (PEFT's names): ``kaiming`` (uniform, bound ``1/sqrt(in)``) or
    ``gaussian`` (std ``1/rank``)."""


@dataclass
class ModelConfig:
    path: str = "???"
    """HF folder (``*ForCausalLM`` to start a reward model from an LM, or
    ``*ForSequenceClassification``) or a megatron_rlhf checkpoint folder."""
    dtype: str = "auto"
    """Parameter dtype: ``auto`` (float32 on CPU, bfloat16 on GPU), float32, bfloat16."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters instead of full fine-tuning (``rank`` 0: off). Checkpoints keep adapters
    beside the frozen base; loading one for another job, and ``convert mcore-to-hf``, merge them."""


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size. Data-parallel size is whatever the world size leaves."""
    ep: int = 1
    """Expert-parallel size (MoE): each of ``ep`` ranks holds ``num_experts / ep`` experts. The
    experts of a pipeline stage are spread over its ``tp * dp`` ranks."""
    etp: int = 1
    """Expert tensor-parallel size: ranks splitting each expert's matrices (1: whole experts)."""
    num_layers_in_first_pipeline_stage: Optional[int] = None
    """Layers of the first pipeline stage when it differs from the others (megatron-core's
    option of that name; the middle stages share the rest equally). Unset, and ``pp`` does not
    divide the layers: split automatically, as evenly as megatron-core allows (said in the log)."""
    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Layers of the last pipeline stage when it differs from the others."""
    sequence_parallel: bool = False
    """Split activations along the sequence over the TP ranks outside attention and MLP
    matmuls (needs tp > 1; MoE models with tp > 1 require it)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state and fp32 main weights over data-parallel ranks (ZeRO-1)."""
    recompute_granularity: Optional[str] = None
    """Activation recompute: ``full`` (whole layers) or ``selective`` (``recompute_modules``)."""
    recompute_method: Optional[str] = None
    """Full recompute: ``uniform`` (chunks of ``recompute_num_layers``, the default) or ``block``
    (the first ``recompute_num_layers`` layers of each stage)."""
    recompute_num_layers: Optional[int] = None
    """Full recompute: layers per chunk (uniform) or per stage (block); default 1."""
    recompute_modules: Optional[list[str]] = None
    """Selective recompute: any of core_attn, mlp, moe, shared_experts, layernorm, mla_up_proj
    (default core_attn)."""


@dataclass
class DataConfig:
    """Fields every trainer's data section has. An example is a preference pair (reward model)
    or a prompt/response sample (SFT)."""

    train_files: list[str] = field(default_factory=list)
    """Training Parquet files (columns: see the trainer)."""
    val_files: list[str] = field(default_factory=list)
    """Held-out Parquet files, same layout; validation runs every ``trainer.eval_every_steps``."""
    max_prompt_length: int = 512
    """Longest prompt, in tokens (after the chat template)."""
    max_response_length: int = 512
    """Longest response, in tokens."""
    overlong: str = "truncate"
    """Examples over a limit: ``truncate`` (keep the prompt's end and the response's start) or
    ``drop``; the counts are reported at start."""
    train_batch_size: int = 64
    """Examples (preference pairs for train-rm, conversations for sft) per optimizer step,
    global (summed over data-parallel ranks)."""
    micro_batch_size_per_rank: int = 8
    """Examples (pairs, conversations) per forward/backward pass on one data-parallel rank."""
    use_remove_padding: bool = True
    """Pack sequences into rows of ``max_prompt_length + max_response_length`` tokens instead of
    padding each to the longest: projections and MLPs see no padding tokens."""
    shuffle: bool = True
    """Shuffle the examples each epoch (seeded by ``trainer.seed`` and the epoch)."""
    """Reshuffle the training examples every epoch (seeded by ``trainer.seed`` and the epoch)."""


@dataclass
class PreferenceDataConfig(DataConfig):
    """Files with ``prompt``, ``chosen``, ``rejected`` (strings or chat message lists); an example
    is a pair, so ``train_batch_size`` counts pairs."""

    margin_column: Optional[str] = None
    """Optional float column holding each pair's required reward margin."""
    share_prompts: Optional[bool] = None
    """The two sides of a pair share their prompt in a packed row: the prompt once, then each
    response attending to it and to itself, at the positions it has after the prompt (its
    forward and backward computed once, exactly). Unset: on wherever rows are packed
    (``use_remove_padding``, megatron's own attention); ``true`` where it cannot apply is an
    error; ``false``: a copy per side."""


@dataclass
class OptimConfig:
    lr: float = 1e-5
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the cosine decay."""
    warmup_steps_ratio: float = 0.03
    """Fraction of the total optimizer steps spent warming up linearly from 0."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""


@dataclass
class RMLossConfig:
    center_coef: float = 0.0
    """Weight of the reward-centering term ``(r_c + r_r)^2``."""


@dataclass
class TrainerConfig:
    total_epochs: int = 1
    """Passes over the training pairs."""
    output_dir: str = "runs/rm"
    """Run folder: checkpoints/, tensorboard/, and the final model."""
    logger: Any = "tensorboard"
    """One of ``console`` (the progress line only; always printed), ``tensorboard`` (under
    ``output_dir/tensorboard``) and ``wandb`` (under ``output_dir/wandb``; offline unless
    ``WANDB_MODE`` is set; the ``[wandb]`` extra), or a list of them:
    ``[console,tensorboard,wandb]``. Every logger gets the same scalar names."""
    resume: str = "auto"
    """``auto``: continue from the newest complete checkpoint in ``output_dir``; ``disable``."""
    save_every_steps: int = 0
    """Save a checkpoint every N optimizer steps (0: only at the end)."""
    keep_last_n: int = 2
    """Checkpoints kept; older ones are deleted after a newer one is complete."""
    eval_every_steps: int = 0
    """Validate every N optimizer steps (0: only at the end)."""
    log_every_steps: int = 1
    """Progress line and scalars every N optimizer steps."""
    seed: int = 1
    """Seed for data order, head initialisation and RNG trackers."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0: run all epochs)."""
    stop_signals: list = field(default_factory=lambda: ["SIGUSR1", "SIGTERM"])
    """Signals that stop the run cleanly: at the next step boundary every rank agrees, a
    checkpoint is written, the loggers are flushed and the process exits with code 75
    (``EXIT_STOPPED``: resume with the same command). ``[]``: the signals' default actions."""
    stop_at: str = "auto"
    """A wall-clock deadline, stopped at as a signal is: ``auto`` (the Slurm job's end,
    ``SLURM_JOB_END_TIME``, when set), ``none``, a Unix time, an ISO date-time
    (``2026-12-03T06:00``, local time unless it names a zone), or a duration counted from the
    job's start (``SLURM_JOB_START_TIME``, else the launch of the command): ``90m``, ``4h``,
    ``1h30m``, ``3600s``. The run stops when less time is left than its longest step plus twice
    its longest save plus ``trainer.stop_margin_s``."""
    stop_margin_s: float = 60.0
    """Seconds kept free before ``trainer.stop_at`` beyond the measured step and save times."""
    async_save: bool = False
    """Write checkpoint shards in a background process (megatron-core's asynchronous
    ``dist_checkpointing`` save) while training continues; a checkpoint is committed at a
    later step boundary once every rank's writer has finished."""


@dataclass
class RMConfig:
    """``megatron-rlhf train-rm``: a Bradley-Terry reward model."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: RMLossConfig = field(default_factory=RMLossConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


@dataclass
class ToolConfig:
    """One tool the policy may call (``rollout.tools``, an SFT run's ``data.tools``; docs/tools.md)."""

    name: str = "???"
    """Unique; the name the policy writes in a call."""
    fn: str = ""
    """``python`` (the code runs in the sandbox; its output is the answer), ``calculator``
    (arithmetic), or ``package.module:function`` called with the call's arguments as keywords
    (and ``row=``, the sample's row, if it has that parameter) returning text. Empty: the
    built-in named ``name``."""
    description: str = ""
    """What the model reads about the tool; empty: a built-in's own."""
    parameters: dict[str, Any] = field(default_factory=dict)
    """JSON schema of the call's arguments (``type: object``); empty: a built-in's own. Calls
    whose arguments do not fit get an error message back."""
    timeout_s: float = 10.0
    """Wall-clock seconds a call may take (``python``: also its CPU seconds); past it the call is
    killed and the policy reads a timeout message."""
    max_response_tokens: int = 256
    """A result is cut to this many tokens of the policy's tokenizer (``python``: its output is
    read up to 8 bytes a token, the process killed past that)."""


@dataclass
class SFTDataConfig(DataConfig):
    """Files with ``prompt`` (string or messages) and ``response`` (string or messages) columns;
    an example is a sample, so ``train_batch_size`` counts samples. A response of several
    messages (assistant turns, tool results) is trained on its assistant turns only."""

    tools: list[ToolConfig] = field(default_factory=list)
    """Tools shown to the model in every prompt, through the chat template's ``tools=`` as an RL
    run's ``rollout.tools`` are (train on tool-call traces with the tools the RL run will give)."""


@dataclass
class SFTConfig:
    """``megatron-rlhf sft``: supervised fine-tuning, loss on response tokens only."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(output_dir="runs/sft"))


def prompt_sharing(requested: bool | None, packing: bool) -> bool:
    """``data.share_prompts`` resolved: unset means wherever rows are packed; ``true`` without
    packed rows (Transformer Engine's kernels, which ignore the layout's mask) is an error,
    never a silent fallback to copies."""
    if requested is None:
        return packing
    if requested and not packing:
        raise UserError("data.share_prompts=true needs packed rows: data.use_remove_padding=true "
                        "with megatron's own attention (Transformer Engine's kernels ignore the "
                        "shared-prompt mask); set data.share_prompts=false or leave it unset")
    return requested
