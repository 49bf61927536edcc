"""The ``*.lora`` settings (``model.lora``, ``actor.lora``, ``critic.lora``) -> checked specs."""

from __future__ import annotations

from megatron_rlhf.config.ppo_schema import PPOConfig
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


def check_ppo_lora(cfg: PPOConfig) -> None:
    """``actor.lora`` and ``critic.lora`` checked; with actor adapters the reference policy is
    the actor's own base (adapters off), so settings for a second reference model are refused."""
    lora_spec("critic.lora", cfg.critic.lora)
    a = cfg.actor
    if not lora_spec("actor.lora", a.lora).rank:
        return
    if a.ref_model_path and a.ref_model_path != a.model_path:
        raise UserError(f"config: actor.ref_model_path={a.ref_model_path} with actor.lora.rank="
                        f"{a.lora.rank}: the reference policy is the actor's base (its adapters "
                        "switched off), no second model is loaded; leave actor.ref_model_path "
                        "unset (or train without LoRA)")
    for index, agent in enumerate(cfg.agents):
        if agent.reference_path and agent.reference_path != agent.model_path:
            raise UserError(f"config: agents[{index}].reference_path with actor.lora.rank="
                            f"{a.lora.rank}: each agent's reference is its own base (adapters "
                            "off); leave reference_path unset")
    off = a.ref_offload
    if off.params or off.grads or off.optimizer:
        raise UserError(f"config: actor.ref_offload with actor.lora.rank={a.lora.rank}: there is "
                        "no separate reference model to offload (the reference is the actor's "
                        "base, adapters off); use actor.offload")
