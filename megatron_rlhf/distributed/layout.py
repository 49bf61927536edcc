"""Parallel layouts: validated before any process group exists, then turned into explicit groups.

This module is the only code that creates model-parallel process groups. Everything downstream
receives a :class:`ParallelGroups` (megatron's ``ProcessGroupCollection`` plus our ranks) as an
argument instead of reading megatron's module globals.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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


def even_split(num_layers: int, pp: int) -> tuple[int | None, int | None]:
    """(first, last) stage layer counts for ``num_layers`` over ``pp`` stages as megatron-core
    allows them (only the first and last stage may differ; the middle ones are equal): none when
    ``pp`` divides the layers, else the split whose largest stage is smallest, the first stage
    (which also holds the embedding) never the larger of the two ends."""
    if pp == 1 or num_layers % pp == 0:
        return None, None
    if pp == 2:
        return num_layers // 2, num_layers - num_layers // 2
    best = None
    for middle in range(1, num_layers // (pp - 2) + 1):
        ends = num_layers - (pp - 2) * middle
        if ends < 2:
            break
        first, last = ends // 2, ends - ends // 2
        key = (max(first, last, middle), abs(first - middle) + abs(last - middle))
        if best is None or key < best[0]:
            best = (key, first, last)
    if best is None:
        raise UserError(f"parallel layout: {num_layers} layers cannot fill pp={pp} stages")
    return best[1], best[2]


@dataclass(frozen=True)
class ParallelLayout:
    """Tensor (tp), pipeline (pp), data (dp), expert (ep) and expert-tensor (etp) parallel sizes.

    ``dp=None`` means "whatever the world size leaves": ``world_size // (tp * pp)``. Experts are
    laid out over the same ranks: each pipeline stage's ``tp * dp`` ranks form ``etp * ep``-sized
    expert groups (megatron-core's rule: ``world % (etp * ep * pp) == 0``). ``first_stage_layers``
    / ``last_stage_layers`` are megatron-core's ``num_layers_in_first/last_pipeline_stage``
    when given; else :meth:`stage_ends` splits each model's layers, as evenly as megatron-core
    allows when ``pp`` does not divide them.
    """

    tp: int = 1
    pp: int = 1
    dp: int | None = None
    ep: int = 1
    etp: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    @classmethod
    def of(cls, options) -> "ParallelLayout":
        """From any object with ``tp, pp, ep, etp, first_stage_layers, last_stage_layers`` (a
        command's parsed options)."""
        return cls(tp=options.tp, pp=options.pp, ep=options.ep, etp=options.etp,
                   first_stage_layers=options.first_stage_layers,
                   last_stage_layers=options.last_stage_layers)

    def stage_ends(self, num_layers: int) -> tuple[int | None, int | None]:
        """megatron-core's ``num_layers_in_first/last_pipeline_stage`` for ``num_layers``: the
        given ones, else :func:`even_split`'s (none when ``pp`` divides the layers). Decided per
        model, so one layout serves models of different depths (an A/B test's two policies)."""
        if self.first_stage_layers is not None or self.last_stage_layers is not None:
            return self.first_stage_layers, self.last_stage_layers
        return even_split(num_layers, self.pp)

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layers of each pipeline stage, first to last."""
        first, last = self.stage_ends(num_layers)
        if first is None and last is None:
            return [num_layers // self.pp] * self.pp
        if self.pp == 1:
            return [num_layers]
        inner = self.pp - 2
        if first is None or last is None:  # one end given: the others share the rest equally
            given = first if first is not None else last
            share = (num_layers - given) // (self.pp - 1)
            first, last = (given, share) if first is not None else (share, given)
        rest = num_layers - first - last
        return [first] + ([rest // inner] * inner if inner else []) + [last]

    def stage_of(self, num_layers: int, stage: int) -> tuple[int, int]:
        """(first global layer index, layer count) of pipeline stage ``stage``."""
        counts = self.stage_layers(num_layers)
        return sum(counts[:stage]), counts[stage]

    def describe_stages(self, num_layers: int) -> str | None:
        """One line on an uneven split (None when the stages are equal)."""
        first, last = self.stage_ends(num_layers)
        if first is None and last is None:
            return None
        counts = self.stage_layers(num_layers)
        middle = f" / {len(counts) - 2} x {counts[1]}" if len(counts) > 2 else ""
        how = ("as given" if (self.first_stage_layers, self.last_stage_layers) != (None, None)
               else "split automatically, as evenly as megatron-core allows; "
                    "num_layers_in_first/last_pipeline_stage choose another")
        return (f"{num_layers} layers over pp={self.pp}: stages of {counts[0]}{middle} / "
                f"{counts[-1]} layers ({how})")

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
        return replace(self, dp=dp)

    def _check_stages(self, num_layers: int) -> str | None:
        """Why the stage split does not fit ``num_layers``, or None."""
        first, last, pp = self.first_stage_layers, self.last_stage_layers, self.pp
        if num_layers < pp:
            return f"{num_layers} layers cannot fill pp={pp} stages"
        if first is None and last is None:
            return None  # split by even_split
        if pp == 1:
            return "num_layers_in_first/last_pipeline_stage need pp > 1"
        for name, value in (("first", first), ("last", last)):
            if value is not None and value < 1:
                return f"num_layers_in_{name}_pipeline_stage={value} must be >= 1"
        counts = self.stage_layers(num_layers)
        middle = num_layers - counts[0] - counts[-1]
        if pp > 2 and (middle < pp - 2 or middle % (pp - 2)):
            return (f"{num_layers} layers minus the first ({counts[0]}) and last ({counts[-1]}) "
                    f"stages leave {middle}, which the {pp - 2} middle stage(s) cannot share "
                    "evenly")
        if sum(counts) != num_layers or min(counts) < 1:
            return (f"stages of {' + '.join(map(str, counts))} layers do not add up to the "
                    f"model's {num_layers}")
        return None

    def _check_shape(self, shape: ModelShape) -> None:
        checks = [
            (shape.num_attention_heads % self.tp, f"attention heads ({shape.num_attention_heads})"
             f" are not divisible by tp={self.tp}"),
            (shape.num_query_groups % self.tp, f"key/value heads ({shape.num_query_groups}) are not"
             f" divisible by tp={self.tp}"),
            (self._check_stages(shape.num_layers) is not None,
             self._check_stages(shape.num_layers)),
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
        ends = [f"{name} stage {count} layers" for name, count in
                (("first", self.first_stage_layers), ("last", self.last_stage_layers))
                if count is not None]
        stages = f" ({', '.join(ends)})" if ends else ""
        return f"tp={self.tp} pp={self.pp} dp={self.dp}{experts}{stages}"


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

    @property
    def expt_dp_rank(self) -> int:
        """Rank among the ranks holding the same experts (the routed experts' data parallelism)."""
        return dist.get_rank(self.collection.expt_dp)

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
