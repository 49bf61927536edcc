"""Parallel layouts: validated before any process group exists, then turned into explicit groups.

This module is the only code that creates model-parallel process groups. Everything downstream
receives a :class:`ParallelGroups` (megatron's ``ProcessGroupCollection`` plus our ranks) as an
argument instead of reading megatron's module globals.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from megatron_rlhf.errors import UserError


@dataclass(frozen=True)
class ModelShape:
    """The model numbers a layout must divide."""

    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    num_experts: int = 0


@dataclass(frozen=True)
class ParallelLayout:
    """Tensor (tp), pipeline (pp), data (dp), expert (ep) and expert-tensor (etp) parallel sizes.

    ``dp=None`` means "whatever the world size leaves": ``world_size // (tp * pp)``. Experts are
    laid out over the same ranks: each pipeline stage's ``tp * dp`` ranks form ``etp * ep``-sized
    expert groups (megatron-core's rule: ``world % (etp * ep * pp) == 0``).
    """

    tp: int = 1
    pp: int = 1
    dp: int | None = None
    ep: int = 1
    etp: int = 1

    def resolve(self, world_size: int, shape: ModelShape | None = None) -> "ParallelLayout":
        """Check the layout against the world and the model; return it with ``dp`` filled in.

        Raises :class:`UserError` naming the offending numbers; nothing is created.
        """
        for name in ("tp", "pp", "ep", "etp"):
            if getattr(self, name) < 1:
                raise UserError(f"parallel layout: {name}={getattr(self, name)} must be >= 1")
        model_parallel = self.tp * self.pp
        if world_size % model_parallel:
            raise UserError(
                f"parallel layout: world size {world_size} is not divisible by "
                f"tp*pp = {self.tp}*{self.pp} = {model_parallel}")
        dp = world_size // model_parallel
        if self.dp is not None and self.dp != dp:
            raise UserError(
                f"parallel layout: dp={self.dp} but world size {world_size} / (tp*pp={model_parallel})"
                f" gives dp={dp}")
        if (self.tp * dp) % (self.etp * self.ep):
            raise UserError(f"parallel layout: etp*ep = {self.etp}*{self.ep} must divide the "
                            f"{self.tp * dp} ranks of a pipeline stage (tp*dp = {self.tp}*{dp})")
        if shape is not None:
            self._check_shape(shape)
        return ParallelLayout(tp=self.tp, pp=self.pp, dp=dp, ep=self.ep, etp=self.etp)

    def _check_shape(self, shape: ModelShape) -> None:
        checks = [
            (shape.num_attention_heads % self.tp, f"attention heads ({shape.num_attention_heads})"
             f" are not divisible by tp={self.tp}"),
            (shape.num_query_groups % self.tp, f"key/value heads ({shape.num_query_groups}) are not"
             f" divisible by tp={self.tp}"),
            (shape.num_layers % self.pp, f"layers ({shape.num_layers}) are not divisible by"
             f" pp={self.pp}"),
            (shape.vocab_size < 1, f"vocab size {shape.vocab_size} must be positive"),
        ]
        if shape.num_experts:
            checks.append((shape.num_experts % self.ep,
                           f"experts ({shape.num_experts}) are not divisible by ep={self.ep}"))
        else:
            checks.append((self.ep != 1, f"ep={self.ep} needs a mixture-of-experts model"))
            checks.append((self.etp != 1, f"etp={self.etp} needs a mixture-of-experts model"))
        for failed, message in checks:
            if failed:
                raise UserError(f"parallel layout: {message}")

    def __str__(self) -> str:
        experts = f" ep={self.ep} etp={self.etp}" if self.ep > 1 or self.etp > 1 else ""
        return f"tp={self.tp} pp={self.pp} dp={self.dp}{experts}"


@dataclass
class ParallelGroups:
    """The process groups and ranks of one layout, passed explicitly to models and loops."""

    layout: ParallelLayout
    collection: object  # megatron.core.process_groups_config.ProcessGroupCollection

    @property
    def tp(self):
        return self.collection.tp

    @property
    def pp(self):
        return self.collection.pp

    @property
    def dp(self):
        return self.collection.dp

    @property
    def tp_rank(self) -> int:
        return dist.get_rank(self.collection.tp)

    @property
    def pp_rank(self) -> int:
        return dist.get_rank(self.collection.pp)

    @property
    def dp_rank(self) -> int:
        return dist.get_rank(self.collection.dp)

    @property
    def ep(self):
        """Expert-parallel group: its ranks hold different experts of the same layers."""
        return self.collection.ep

    @property
    def etp(self):
        """Expert-tensor-parallel group: its ranks hold pieces of the same experts."""
        return self.collection.expt_tp

    @property
    def ep_rank(self) -> int:
        return dist.get_rank(self.collection.ep) if self.layout.ep > 1 else 0

    @property
    def etp_rank(self) -> int:
        return dist.get_rank(self.collection.expt_tp) if self.layout.etp > 1 else 0

    def expert_offset(self, num_experts: int) -> int:
        """Global index of this rank's first local expert."""
        return self.ep_rank * (num_experts // self.layout.ep) if num_experts else 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1


def build_parallel_groups(layout: ParallelLayout, shape: ModelShape | None = None,
                          seed: int = 1234) -> ParallelGroups:
    """Validate ``layout`` and create its groups on the running world (replacing any old ones).

    Also seeds megatron's model-parallel RNG tracker, which attention forks on every call.
    """
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        raise RuntimeError("init_distributed() must run before build_parallel_groups()")
    resolved = layout.resolve(dist.get_world_size(), shape)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=resolved.tp,
        pipeline_model_parallel_size=resolved.pp,
        expert_model_parallel_size=resolved.ep,
        expert_tensor_parallel_size=resolved.etp,
    )
    model_parallel_cuda_manual_seed(seed)
    return ParallelGroups(layout=resolved, collection=ProcessGroupCollection.use_mpu_process_groups())
