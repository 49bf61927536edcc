"""Training machinery shared by every trainer: Megatron DDP, optimizer, LR schedule, one step.

Trainers bring a model, micro-batches and a loss function; this module owns how gradients are
accumulated over micro-batches, reduced over data-parallel ranks (megatron DDP), clipped and
applied (megatron optimizer) under any TP/PP layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_rlhf.config.schema import LoRAConfig, OptimConfig
from megatron_rlhf.data.packing import pad_to_common_shape
from megatron_rlhf.distributed.layout import ParallelGroups
from megatron_rlhf.distributed.platform import device, platform_is_cpu
from megatron_rlhf.errors import UserError
from megatron_rlhf.models.forward import model_forward, run_schedule
from megatron_rlhf.trainers.moe_metrics import MoEMonitor


def training_dtype(name: str) -> torch.dtype:
    """``model.dtype``: ``auto`` is float32 on CPU and bfloat16 on GPU."""
    if name == "auto":
        return torch.float32 if platform_is_cpu() else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def packing_supported(requested: bool, tag: str) -> bool:
    """Whether ``data.use_remove_padding`` can be honoured by the layers this process builds.

    Transformer Engine's causal kernels ignore our block-diagonal mask and THD inputs are not
    wired up yet, so with TE the trainers pad instead (and say so).
    """
    from megatron_rlhf.distributed.launch import discover_rank
    from megatron_rlhf.models.builder import uses_transformer_engine

    if requested and uses_transformer_engine():
        if discover_rank().rank == 0:  # runs before the process group exists
            print(f"[{tag}] data.use_remove_padding is not supported with Transformer Engine yet: "
                  "padding instead", flush=True)
        return False
    return requested


def check_prompt_sharing(share: bool, arch, parallel, tag: str) -> None:
    """Multi-latent attention computes RoPE inside each layer: under full recompute with a
    pipeline, the backward of one micro-batch recomputes it while the next one's positions are
    set (1F1B), so shared prompts are refused there in one line."""
    if share and arch.mla is not None and parallel.recompute_granularity == "full" and parallel.pp > 1:
        raise UserError(f"{tag}: data.share_prompts with multi-latent attention under full "
                        "recompute at pipeline_model_parallel_size > 1 is not supported: set "
                        "data.share_prompts=false, or recompute_granularity=selective")


@dataclass
class Trainable:
    """A model wrapped for training with its optimizer and LR scheduler."""

    model: Any  # megatron DistributedDataParallel
    optimizer: Any  # megatron MegatronOptimizer
    scheduler: Any  # megatron OptimizerParamScheduler
    groups: ParallelGroups
    moe: MoEMonitor | None = None  # routing statistics of a mixture-of-experts model

    @property
    def module(self):
        return self.model.module


def add_adapters(model, settings: LoRAConfig, seed: int, tag: str, key: str = "model.lora") -> dict:
    """LoRA adapters on ``model`` as ``settings`` (the ``*.lora`` section at config ``key``) say,
    the rest frozen; returns the checkpoint metadata that rebuilds them (empty when ``rank`` is
    0: no change)."""
    from megatron_rlhf.config.lora import lora_spec
    from megatron_rlhf.models.lora import apply_lora

    spec = lora_spec(key, settings, seed)
    adapted = apply_lora(model, spec)
    if not adapted:
        return {}
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[{tag}] LoRA rank {spec.rank} on {len(adapted)} linears of this stage: "
              f"{trainable:,} trainable parameters of {total:,} on rank 0", flush=True)
    return {"lora": spec.as_dict()}


def make_trainable(model, groups: ParallelGroups, optim: OptimConfig, total_steps: int,
                   distributed_optimizer: bool = False) -> Trainable:
    """Wrap ``model`` in megatron DDP and build Adam + warm-up/cosine schedule over ``total_steps``;
    ``distributed_optimizer`` shards optimizer state and main weights over data-parallel ranks."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = model.config
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, check_for_nan_in_grad=False,
                                      use_distributed_optimizer=distributed_optimizer),
        model,
        pg_collection=groups.collection,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=optim.lr, min_lr=optim.min_lr,
                        weight_decay=optim.weight_decay, adam_beta1=optim.betas[0],
                        adam_beta2=optim.betas[1], adam_eps=optim.eps, clip_grad=optim.clip_grad,
                        bf16=config.bf16, params_dtype=config.params_dtype,
                        use_distributed_optimizer=distributed_optimizer),
        [ddp],
        use_gloo_process_groups=False,
        pg_collection=groups.collection,
    )
    warmup = int(optim.warmup_steps_ratio * total_steps)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=optim.lr, min_lr=optim.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=max(total_steps, warmup + 1), lr_decay_style="cosine",
        start_wd=optim.weight_decay, end_wd=optim.weight_decay, wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant",
        # On resume the config wins (e.g. more epochs); an unchanged config resumes exactly.
        override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False)
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    monitor = MoEMonitor(model, groups) if config.num_moe_experts else None
    return Trainable(ddp, optimizer, scheduler, groups, monitor)


@dataclass
class StepResult:
    metrics: list[dict]  # per micro-batch, last pipeline stage only ([] elsewhere)
    grad_norm: float
    lr: float
    moe: dict[str, float]  # the step's ``moe/*`` scalars (every rank; empty for dense models)


def train_step(trainable: Trainable, micro_batches: list[dict],
               loss_fn: Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]],
               raise_on_nonfinite: bool = True, hidden_states: bool = False,
               replay=None) -> StepResult:
    """One optimizer step over ``micro_batches`` (this rank's share of the global batch).

    Inf/NaN gradients raise :class:`UserError`, or with ``raise_on_nonfinite=False`` come back as
    a NaN ``grad_norm`` for a caller that can undo the step (PPO's rollback guard).
    ``hidden_states``: the last stage's output is its hidden states, not logits (see
    :func:`megatron_rlhf.models.output_head.hidden_states_out`). ``replay``: MoE routing replay
    (:class:`~megatron_rlhf.models.routing_replay.RoutingReplay`), driven per micro-batch.

    ``loss_fn(output, batch)`` gets the last stage's output (``[b, t, ...]``, padded rows included
    when PP > 1) and returns the micro-batch's mean loss and a dict of metric sums. Megatron averages the loss over micro-batches
    and DDP averages gradients over data-parallel ranks.
    """
    model, groups = trainable.model, trainable.groups
    model.train()
    model.zero_grad_buffer()
    trainable.optimizer.zero_grad()
    if groups.layout.pp > 1:
        micro_batches = pad_to_common_shape(micro_batches)

    def forward_step(data_iterator, stage_model):
        batch = next(data_iterator)
        return (model_forward(stage_model, batch, hidden_states, replay),
                lambda output: loss_fn(output, batch))

    metrics = run_schedule(model, groups, micro_batches, forward_step, forward_only=False)
    lr = trainable.optimizer.param_groups[0]["lr"]  # the rate this step applies
    success, grad_norm, _ = trainable.optimizer.step()
    if not success:
        if raise_on_nonfinite:
            raise UserError("optimizer step skipped: gradients contain inf or NaN")
        grad_norm = math.nan
    if raise_on_nonfinite and grad_norm is not None and not math.isfinite(grad_norm):
        raise UserError(f"gradient norm is {grad_norm}")
    trainable.scheduler.step(increment=1)
    grad_norm = 0.0 if grad_norm is None else float(grad_norm)
    moe = trainable.moe.collect(len(micro_batches)) if trainable.moe is not None else {}
    return StepResult(list(metrics) if groups.is_last_stage else [], grad_norm, lr, moe)


def set_lr_scale(trainable: Trainable, optim: OptimConfig, scale: float) -> None:
    """Run ``trainable``'s schedule between ``scale`` x the configured rates from now on.

    megatron-core keeps ``max_lr``/``min_lr`` in every optimizer param group and reads those
    before the scheduler's own, so both are set.
    """
    scheduler = trainable.scheduler
    scheduler.max_lr, scheduler.min_lr = optim.lr * scale, optim.min_lr * scale
    for group in trainable.optimizer.param_groups:
        group["max_lr"], group["min_lr"] = scheduler.max_lr, scheduler.min_lr
    scheduler.step(increment=0)


def reduce_metrics(metrics: list[dict], groups: ParallelGroups, keys: list[str]) -> dict[str, float]:
    """Sum per-micro-batch metric sums over micro-batches and the whole world; every rank gets them.

    Only the last pipeline stage holds metrics, and its TP ranks hold identical copies.
    """
    values = torch.zeros(len(keys), dtype=torch.float64, device=device())
    for entry in metrics:
        values += torch.stack([entry[k].detach().double().to(device()) for k in keys])
    dist.all_reduce(values)
    values /= groups.layout.tp
    return dict(zip(keys, values.tolist()))
