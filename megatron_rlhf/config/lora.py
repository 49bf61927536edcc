"""The ``*.lora`` settings (``model.lora``, ``actor.lora``, ``critic.lora``) -> checked specs."""

from __future__ import annotations

from megatron_rlhf.config.schema import LoRAConfig
from megatron_rlhf.errors import UserError
from megatron_rlhf.models.lora import LoRASpec, check_spec


def lora_spec(prefix: str, settings: LoRAConfig, seed: int = 0) -> LoRASpec:
    """The :class:`LoRASpec` of the settings at config key ``prefix``, checked (a bad target, rank,
    alpha, dropout or init raises one :class:`UserError` naming ``prefix``)."""
    spec = LoRASpec(rank=settings.rank, alpha=settings.alpha, dropout=settings.dropout,
                    target_modules=tuple(settings.target_modules), init=settings.init, seed=seed)
    check_spec(spec, f"config: {prefix}")
    return spec


def refuse_untrained_lora(prefix: str, settings: LoRAConfig, job: str) -> None:
    """Checks the settings, then refuses adapters in a job that does not run them yet (PPO: its
    workers' weight sync to the rollout engine and its reference model do not know them)."""
    if lora_spec(prefix, settings).rank:
        raise UserError(f"config: {prefix}.rank={settings.rank}: LoRA training is not wired into "
                        f"`megatron-rlhf {job}` yet (weight sync and the reference model); "
                        "leave rank at 0")
