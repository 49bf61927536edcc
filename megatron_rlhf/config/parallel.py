"""``parallel.*`` and ``moe.*`` sections -> the layout and model options, with megatron-core's rules
checked before any process group exists: each broken rule is one line naming the keys."""

from __future__ import annotations

from megatron_rlhf.config.schema import MoEConfig, ParallelConfig
from megatron_rlhf.distributed.layout import ParallelLayout
from megatron_rlhf.distributed.platform import platform_is_cpu
from megatron_rlhf.errors import UserError
from megatron_rlhf.models.hf_config import ModelArch
from megatron_rlhf.models.megatron_config import ModelOptions

RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "shared_experts", "layernorm", "mla_up_proj",
                     "moe_act")


def layout_of(parallel: ParallelConfig) -> ParallelLayout:
    return ParallelLayout(tp=parallel.tp, pp=parallel.pp, ep=parallel.ep, etp=parallel.etp,
                          first_stage_layers=parallel.num_layers_in_first_pipeline_stage,
                          last_stage_layers=parallel.num_layers_in_last_pipeline_stage)


def model_options(parallel: ParallelConfig, moe: MoEConfig) -> ModelOptions:
    granularity = parallel.recompute_granularity
    full = granularity == "full"
    return ModelOptions(
        sequence_parallel=parallel.sequence_parallel,
        recompute_granularity=granularity,
        recompute_method=(parallel.recompute_method or "uniform") if full else None,
        recompute_num_layers=(parallel.recompute_num_layers or 1) if full else None,
        recompute_modules=(tuple(parallel.recompute_modules or ("core_attn",))
                           if granularity == "selective" else None),
        moe_aux_loss_coef=moe.aux_loss_coef, moe_z_loss_coef=moe.z_loss_coef,
        moe_load_balancing=moe.load_balancing,
        moe_expert_bias_update_rate=moe.expert_bias_update_rate,
        moe_token_dispatcher=moe.token_dispatcher, expert_tensor_parallel_size=parallel.etp)


def _choice(name: str, value, allowed) -> None:
    if value is not None and value not in allowed:
        raise UserError(f"config: {name}={value!r} must be one of {', '.join(allowed)}")


def check_parallel(prefix: str, parallel: ParallelConfig, moe: MoEConfig) -> None:
    """What needs no model: ranges and choices of ``prefix`` (``parallel``, ``actor.parallel``)."""
    _choice(f"{prefix}.recompute_granularity", parallel.recompute_granularity, ("full", "selective"))
    _choice(f"{prefix}.recompute_method", parallel.recompute_method, ("uniform", "block"))
    for module in parallel.recompute_modules or ():
        _choice(f"{prefix}.recompute_modules", module, RECOMPUTE_MODULES)
    if parallel.recompute_granularity != "full" and (parallel.recompute_method
                                                     or parallel.recompute_num_layers):
        raise UserError(f"config: {prefix}.recompute_method/recompute_num_layers apply to "
                        f"{prefix}.recompute_granularity=full only")
    if parallel.recompute_granularity != "selective" and parallel.recompute_modules:
        raise UserError(f"config: {prefix}.recompute_modules applies to "
                        f"{prefix}.recompute_granularity=selective only")
    if parallel.recompute_num_layers is not None and parallel.recompute_num_layers < 1:
        raise UserError(f"config: {prefix}.recompute_num_layers={parallel.recompute_num_layers} "
                        "must be >= 1")
    if "moe_act" in (parallel.recompute_modules or ()):
        raise UserError(f"config: {prefix}.recompute_modules=moe_act needs grouped-GEMM experts, "
                        "which megatron-rlhf does not build; recompute 'moe' instead")
    if parallel.sequence_parallel and parallel.tp < 2:
        raise UserError(f"config: {prefix}.sequence_parallel=true needs {prefix}.tp > 1")
    if parallel.etp > 1 and platform_is_cpu():
        raise UserError(f"config: {prefix}.etp={parallel.etp} needs NCCL: over gloo, expert "
                        "tensor parallelism's uneven all-gather of tokens fails")
    _choice("moe.load_balancing", moe.load_balancing, ("aux_loss", "seq_aux_loss"))
    _choice("moe.token_dispatcher", moe.token_dispatcher, ("alltoall", "allgather"))
    for name in ("aux_loss_coef", "z_loss_coef", "expert_bias_update_rate"):
        if getattr(moe, name) < 0:
            raise UserError(f"config: moe.{name}={getattr(moe, name)} must be >= 0")


def check_parallel_for_model(prefix: str, parallel: ParallelConfig, arch: ModelArch,
                             training: bool = True) -> None:
    """Rules that depend on the model: megatron-core enforces them later, less clearly."""
    modules = set(parallel.recompute_modules or ())
    if arch.moe is None:
        for key in ("ep", "etp"):
            if getattr(parallel, key) != 1:
                raise UserError(f"config: {prefix}.{key}={getattr(parallel, key)} needs a "
                                f"mixture-of-experts model ({arch.family} has no experts)")
        if modules & {"moe", "shared_experts"}:
            raise UserError(f"config: {prefix}.recompute_modules={sorted(modules)} name MoE "
                            f"modules; {arch.family} has no experts")
    elif training and parallel.tp > 1 and not parallel.sequence_parallel:
        raise UserError(f"config: {prefix}.tp={parallel.tp} with a mixture-of-experts model needs "
                        f"{prefix}.sequence_parallel=true (megatron-core trains MoE + TP only so)")
    if "mla_up_proj" in modules and arch.mla is None:
        raise UserError(f"config: {prefix}.recompute_modules=mla_up_proj needs multi-latent "
                        f"attention ({arch.family} has none)")
    if parallel.recompute_method == "block" and parallel.recompute_num_layers:
        per_stage = min(layout_of(parallel).stage_layers(arch.num_layers))
        if parallel.recompute_num_layers > per_stage:
            raise UserError(f"config: {prefix}.recompute_num_layers={parallel.recompute_num_layers} "
                            f"exceeds the {per_stage} layers of a pipeline stage")

