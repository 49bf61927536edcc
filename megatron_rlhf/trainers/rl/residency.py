"""What of a PPO worker's models is resident in which phase (``actor.offload``,
``actor.ref_offload``, ``critic.offload``, ``reward.offload``).

Each phase brings back only what it needs, and after it everything configured goes out again
(:meth:`Residency.phase`):

=========================  =============================================
phase                      brought back
=========================  =============================================
old / reference log-probs  actor and/or reference parameters
values and RM scores       critic and reward-model parameters
actor update               actor parameters, gradients, optimizer state
critic update              critic parameters, gradients, optimizer state
weight sync                actor parameters
generation                 nothing (the engine has the device)
checkpoint save / load     parameters and optimizer state of the trained models
=========================  =============================================

The engine's side (:meth:`megatron_rlhf.trainers.rl.worker.PPOWorker.generate`) follows
SGLang's order: resume ``weights``, weight sync, trainer state out, resume ``kv_cache``,
generate, release both.

Metrics (:func:`reduce_stats`, per step: everything moved since the previous step's report,
i.e. from the previous weight sync to this step's updates): ``offload/seconds_out`` and
``offload/seconds_in`` (time spent copying out and back), ``offload/bytes`` (bytes copied
out), ``offload/resident_bytes_generating`` (device bytes of the configured state still held
when the engine starts generating: 0 when the trainer has stepped aside); each the largest
over the ranks, the busiest GPU's figure, as the planner's memory is per GPU. None of them
without an offload switch on.
"""

from __future__ import annotations

from contextlib import contextmanager

from megatron_rlhf.config.ppo_schema import OffloadConfig, PPOConfig
from megatron_rlhf.trainers.offload import Moved, Offloader

KEYS = ("offload/seconds_out", "offload/seconds_in", "offload/bytes", "offload/resident_bytes_generating")


def offload_settings(cfg: PPOConfig) -> dict[str, OffloadConfig]:
    """model -> its offload settings (``actor``, ``ref``, ``critic``, ``rm``)."""
    return {"actor": cfg.actor.offload, "ref": cfg.actor.ref_offload, "critic": cfg.critic.offload,
            "rm": cfg.reward.offload}


def offloads(cfg: PPOConfig) -> bool:
    """Whether any offload switch is on."""
    return any(c.params or c.grads or c.optimizer for c in offload_settings(cfg).values())


class Residency:
    """The offloaders of one worker rank's models and the moves of the current step."""

    def __init__(self, models: dict[str, tuple[Offloader, OffloadConfig]]):
        self.models = models
        self.out, self.back = Moved(), Moved()
        self.generating = 0  # the largest resident_configured() seen at a generation's start

    @classmethod
    def of_worker(cls, worker, cfg: PPOConfig) -> "Residency":
        """For the models ``worker`` hosts (attributes ``actor``, ``ref``, ``critic``, ``rm``)
        that have a switch on."""
        models = {}
        for name, settings in offload_settings(cfg).items():
            model = getattr(worker, name, None)
            if model is not None and (settings.params or settings.grads or settings.optimizer):
                models[name] = (Offloader.of(model), settings)
        return cls(models)

    @contextmanager
    def phase(self, **needs: tuple[str, ...]):
        """Bring back ``needs`` (model -> parts, e.g. ``actor=("params",)``), run the phase,
        then send out everything configured."""
        for name, parts in needs.items():
            if name in self.models:
                self.back += self.models[name][0].reload(**dict.fromkeys(parts, True))
        try:
            yield
        finally:
            self.settle()

    def settle(self) -> None:
        """Everything configured out (idempotent)."""
        for offloader, settings in self.models.values():
            self.out += offloader.offload(params=settings.params, grads=settings.grads,
                                          optimizer=settings.optimizer)

    def resident_configured(self) -> int:
        """Device bytes still held of the state the settings send out (0 once settled)."""
        return sum(offloader.resident_bytes(part) for offloader, settings in self.models.values()
                   for part in ("params", "grads", "optimizer") if getattr(settings, part))

    def generation_starts(self) -> None:
        self.generating = max(self.generating, self.resident_configured())

    def take_stats(self) -> dict[str, float]:
        """This rank's moves since the last call (and start counting again); {} without offload."""
        if not self.models:
            return {}
        stats = dict(zip(KEYS, (self.out.seconds, self.back.seconds, float(self.out.bytes),
                                float(self.generating))))
        self.out, self.back, self.generating = Moved(), Moved(), 0
        return stats


def reduce_stats(ranks: list[dict[str, float]]) -> dict[str, float]:
    """The largest value of each key over the ranks that report it."""
    return {key: max(r[key] for r in ranks if key in r) for key in KEYS if any(key in r for r in ranks)}
