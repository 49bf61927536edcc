"""LoRA adapters on megatron-core's tensor-parallel linears (local layer specs).

Each targeted linear ``y = base(x)`` becomes ``y = base(x) + (alpha / rank) * B(A(dropout(x)))``
with ``A: [rank, in]`` and ``B: [out, rank]``. The adapter lives as a child ``adapter`` of the
base linear (so the base's parameter names, and with them the HF map and checkpoints' base keys,
stay as they are) and adds its term through a forward hook on the base.

How tensor parallelism cuts the adapter, so every rank's output shard is exact:

- column-parallel base (``linear_qkv``, ``linear_fc1``; output rows split over TP): ``A`` is
  replicated, ``B``'s rows are split like the base weight's rows on that rank (megatron's fused
  QKV rows, interleaved per query group, and fc1's ``[gate; up]`` halves are already the base's
  local row order, so ``B``'s local rows simply follow it). Without sequence parallelism the
  ``[s, b, rank]`` activation enters the TP region through ``copy_to`` (its gradient, partial per
  rank, is all-reduced: ``A``'s gradient and the input's are then whole on every rank). With it,
  ``A`` runs on this rank's sequence shard and the ``rank``-wide activation is all-gathered along
  the sequence, as the base gathers its input; ``A``'s gradient is then partial per rank and is
  summed over TP by megatron (the parameter is tagged ``sequence_parallel``).
- row-parallel base (``linear_proj``, ``linear_fc2``; input columns split): ``A``'s columns are
  split like the base weight's, ``B`` is replicated. ``A``'s partial ``[s, b, rank]`` output is
  all-reduced (or, with sequence parallelism, reduce-scattered along the sequence) exactly as the
  base reduces its partial output, then ``B`` applies; with sequence parallelism ``B`` sees a
  sequence shard and is tagged ``sequence_parallel`` for the same TP sum.

``A`` is drawn on the full ``[rank, in]`` shape from a generator seeded by the layer's global
name, then cut: every layout gets the same adapter. ``B`` starts at zero, so an adapted model
starts as its base exactly. Applying LoRA freezes every other parameter except a value head.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import zlib
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatron_rlhf.errors import UserError

DENSE_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# Multi-latent attention's projections: column-parallel in megatron's local spec (the down
# projections' outputs are gathered by the attention module after the matmul).
MLA_TARGETS = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj",
               "linear_kv_down_proj", "linear_kv_up_proj")
COLUMN_TARGETS = ("linear_qkv", "linear_fc1") + MLA_TARGETS
ROW_TARGETS = ("linear_proj", "linear_fc2")
SUPPORTED_TARGETS = DENSE_TARGETS + MLA_TARGETS
INITS = ("kaiming", "gaussian")


@dataclass(frozen=True)
class LoRASpec:
    """What to adapt and how (the ``*.lora`` settings); ``rank`` 0 means no adapters."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DENSE_TARGETS
    init: str = "kaiming"
    seed: int = 0  # seeds every adapter's A (with the layer's global name)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def as_dict(self) -> dict:
        """JSON-ready (a checkpoint's metadata); :meth:`from_dict` reads it back."""
        return {**asdict(self), "target_modules": list(self.target_modules)}

    @classmethod
    def from_dict(cls, values: dict) -> "LoRASpec":
        return cls(**{**values, "target_modules": tuple(values["target_modules"])})


def check_spec(spec: LoRASpec, where: str = "lora") -> None:
    """Refuse settings no model could take, with the setting's name (``where``)."""
    if spec.rank < 0:
        raise UserError(f"{where}.rank must be >= 0 (0 = no adapters), got {spec.rank}")
    if spec.rank == 0:
        return
    supported = ", ".join(SUPPORTED_TARGETS)
    for target in spec.target_modules:
        if target not in SUPPORTED_TARGETS:
            raise UserError(f"{where}.target_modules: unknown module {target!r}; supported "
                            f"(megatron-core names): {supported}")
    if not spec.target_modules:
        raise UserError(f"{where}.target_modules is empty; supported: {supported}")
    if spec.alpha <= 0:
        raise UserError(f"{where}.alpha must be > 0, got {spec.alpha}")
    if not 0.0 <= spec.dropout < 1.0:
        raise UserError(f"{where}.dropout must be in [0, 1), got {spec.dropout}")
    if spec.init not in INITS:
        raise UserError(f"{where}.init must be one of {', '.join(INITS)}, got {spec.init!r}")


def initial_a(spec: LoRASpec, key: str, in_features: int) -> torch.Tensor:
    """The full ``[rank, in_features]`` A of the adapter named ``key`` (a layer's global name):
    PEFT's default (``kaiming``: uniform, bound ``1/sqrt(in_features)``) or ``gaussian``
    (std ``1/rank``), from a generator seeded by ``spec.seed`` and ``key``, on CPU in fp32."""
    generator = torch.Generator().manual_seed(spec.seed * 1_000_003 + zlib.crc32(key.encode()))
    a = torch.empty(spec.rank, in_features)
    if spec.init == "kaiming":
        return nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
    return nn.init.normal_(a, std=1.0 / spec.rank, generator=generator)


def _tp_param(tensor: torch.Tensor, dim: int) -> nn.Parameter:
    """A parameter split over TP along ``dim`` (counted once per rank in the gradient norm)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    param = nn.Parameter(tensor)
    set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=1)
    return param


class LoRAAdapter(nn.Module):
    """The ``scale * B(A(dropout(x)))`` term of one column- or row-parallel base linear.

    ``lora_a``: ``[rank, in_local]``, ``lora_b``: ``[out_local, rank]`` (local = this TP rank's
    part, see the module docstring for which one is split).
    """

    def __init__(self, base, spec: LoRASpec, key: str, column: bool, glu: bool = False,
                 expert: bool = False):
        super().__init__()
        self.key = key  # the layout-free name that seeds A (a routed expert's: its global index)
        self.column = column
        self.glu = glu  # B's rows are fc1's [gate; up] halves, each cut over TP
        self.scale = spec.scale
        self.dropout = spec.dropout
        self.enabled = True
        self.tp_group = base.tp_group  # a routed expert's: the expert-TP group (size 1, checked)
        # A routed expert sees the tokens dispatched to it, whole: no sequence shard.
        self.sequence_parallel = bool(base.sequence_parallel) and not expert
        tp, rank = self.tp_group.size(), self.tp_group.rank()
        weight = base.weight
        out_local, in_local = weight.shape
        in_full = in_local if column else in_local * tp
        a = initial_a(spec, key, in_full).to(dtype=weight.dtype)
        b = torch.zeros(out_local, spec.rank, dtype=weight.dtype)
        if column:
            self.lora_a = nn.Parameter(a.to(weight.device))
            self.lora_b = _tp_param(b.to(weight.device), dim=0)
            split_sequence = self.lora_a
        else:
            self.lora_a = _tp_param(a.chunk(tp, dim=1)[rank].contiguous().to(weight.device), 1)
            self.lora_b = nn.Parameter(b.to(weight.device))
            split_sequence = self.lora_b
        # Under sequence parallelism this parameter sees one sequence shard per rank: megatron's
        # finalize_model_grads sums its gradient over TP (as for norm weights).
        split_sequence.sequence_parallel = self.sequence_parallel
        # A routed expert's adapter lives with its expert: megatron's DDP reduces its gradient
        # over the expert-data-parallel ranks, as the expert's own weights (allreduce=False).
        for param in (self.lora_a, self.lora_b):
            param.allreduce = getattr(weight, "allreduce", True)
            if getattr(weight, "sequence_parallel", False):  # a weight whose gradient is summed
                param.sequence_parallel = True                # over TP: its adapter's too
                param.tensor_model_parallel = getattr(weight, "tensor_model_parallel", True)

    def _drop(self, x: torch.Tensor, sharded: bool) -> torch.Tensor:
        """Dropout on the adapter's input; an input that differs across TP ranks (a sequence or
        hidden shard) draws its mask from megatron's model-parallel RNG, as megatron's own
        dropouts in those regions do."""
        if not self.training or self.dropout == 0.0:
            return x
        if not sharded:
            return F.dropout(x, self.dropout, training=True)
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        with get_cuda_rng_tracker().fork():
            return F.dropout(x, self.dropout, training=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: the base's input ``[s, b, in_local]`` (``s`` this rank's sequence shard under
        sequence parallelism) -> the term to add to the base's output (before its bias)."""
        from megatron.core import tensor_parallel as tpl

        sp, group = self.sequence_parallel, self.tp_group
        h = F.linear(self._drop(x, sharded=sp or not self.column), self.lora_a)  # [s, b, rank]
        if self.column:
            h = (tpl.gather_from_sequence_parallel_region(h, group=group) if sp
                 else tpl.copy_to_tensor_model_parallel_region(h, group=group))
        else:
            h = (tpl.reduce_scatter_to_sequence_parallel_region(h, group=group) if sp
                 else tpl.reduce_from_tensor_model_parallel_region(h, group=group))
        return F.linear(h, self.lora_b) * self.scale


def _sharded_state_dict(base, prefix="", sharded_offsets=(), metadata=None):
    """The base linear's checkpoint entries with its adapter's split parameter cut over TP as
    the base weight is (``B`` along rows, fc1's per gate/up half; ``A`` along columns), so a
    checkpoint reloads under any TP/PP layout; the replicated one is saved once."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

    state = type(base).sharded_state_dict(base, prefix, sharded_offsets, metadata)
    adapter = base.adapter
    name, axis = ("lora_b", 0) if adapter.column else ("lora_a", 1)
    key = f"{prefix}adapter.{name}"
    state[key] = make_tp_sharded_tensor_for_checkpoint(
        getattr(adapter, name), key, axis, prepend_offsets=sharded_offsets,
        tp_group=base.tp_group, dp_cp_group=metadata["dp_cp_group"])
    if adapter.glu:
        singleton = (metadata or {}).get("singleton_local_shards", False)
        state[key] = apply_swiglu_sharded_factory(state[key], sharded_offsets, singleton)
    return state


def _add_adapter_term(base, args, output):
    """Forward hook of an adapted base linear: ``(y, bias) -> (y + adapter(x), bias)``."""
    adapter = base.adapter
    if not adapter.enabled:
        return output
    y, bias = output
    return y + adapter(args[0]).to(y.dtype), bias


_LOCAL_EXPERT = re.compile(r"(.*\.experts)\.local_experts\.(\d+)\.(.+)")


def _targets(layer, spec: LoRASpec):
    """(path inside ``layer``, module, column?, the adapter's layout-free name) for each linear
    of ``layer`` to adapt; a routed expert's name carries its global index (``mlp.experts.5.
    linear_fc1``: the same adapter whichever expert-parallel rank holds it)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    for path, module in layer.named_modules():
        leaf = path.rsplit(".", 1)[-1]
        if leaf not in spec.target_modules:
            continue
        if type(module) not in (ColumnParallelLinear, RowParallelLinear):
            raise UserError(f"LoRA needs megatron-core's local linear layers; {path} is a "
                            f"{type(module).__name__} (Transformer Engine layers: not yet)")
        name, expert = path, _LOCAL_EXPERT.fullmatch(path)
        if expert is not None:
            experts = layer.get_submodule(expert.group(1))
            if module.tp_group.size() > 1:
                raise UserError(f"lora: adapters on routed experts ({path}) need expert tensor "
                                f"parallelism 1 (etp={module.tp_group.size()}): set etp=1")
            index = experts.ep_group.rank() * experts.num_local_experts + int(expert.group(2))
            name = f"{expert.group(1)}.{index}.{expert.group(3)}"
        yield path, module, leaf in COLUMN_TARGETS, name


def _check_width(path: str, base, spec: LoRASpec, column: bool) -> None:
    out_local, in_local = base.weight.shape
    tp = base.tp_group.size()
    width = min(out_local * tp, in_local) if column else min(out_local, in_local * tp)
    if spec.rank > width:
        raise UserError(f"lora.rank {spec.rank} is larger than {path}'s width {width} "
                        "(min of its input and output features)")


def apply_lora(model, spec: LoRASpec) -> list[str]:
    """Adapt ``model``'s (one pipeline stage's ``GPTModel``) targeted linears in place and freeze
    the rest but a value head. Returns the adapted modules' stage-local names (empty when
    ``spec.rank`` is 0: the model is left untouched). Raises :class:`UserError` for targets this
    model does not have or cannot take, and for a rank wider than a targeted layer."""
    from megatron_rlhf.models.builder import ValueHead

    check_spec(spec)
    if spec.rank == 0:
        return []
    if any(True for _ in adapters(model)):
        raise UserError("this model already carries LoRA adapters (merge them first: "
                        "merge_adapters)")
    found = []
    for index, layer in enumerate(model.decoder.layers):
        for path, base, column, name in list(_targets(layer, spec)):
            _check_width(path, base, spec, column)
            found.append((f"decoder.layers.{index}.{path}", base, column,
                          f"layers.{layer.layer_number - 1}.{name}"))
    present = {name.rsplit(".", 1)[-1] for name, *_ in found}
    missing = set(spec.target_modules) - present
    # MLA's queries come one way or the other (q_lora_rank set or not): either form will do.
    if "linear_q_proj" in present:
        missing -= {"linear_q_down_proj", "linear_q_up_proj"}
    if "linear_q_down_proj" in present:
        missing.discard("linear_q_proj")
    if missing and len(model.decoder.layers):
        mla = (" (a multi-latent attention model: its attention linears are linear_q_proj or "
               "linear_q_down_proj and linear_q_up_proj, linear_kv_down_proj, linear_kv_up_proj, "
               "linear_proj)" if "linear_qkv" in missing else "")
        raise UserError(f"lora.target_modules: this model has no {', '.join(sorted(missing))}"
                        f"{mla}; supported: {', '.join(SUPPORTED_TARGETS)}")
    head = getattr(model, "output_layer", None)
    for param in model.parameters():
        param.requires_grad_(False)
    # The routers' expert bias (DeepSeek-V3's aux-loss-free balancing) is base too: megatron
    # moves it after every step, which would make "adapters off" no longer the base (the
    # reference policy) and leave the change out of a PEFT export (0.075 in a tiny
    # DeepSeek-V3's logits after 3 steps). Rate 0 keeps it bitwise.
    if getattr(model.config, "moe_router_enable_expert_bias", False):
        model.config.moe_router_bias_update_rate = 0.0
    if isinstance(head, ValueHead):
        head.weight.requires_grad_(True)
    for name, base, column, key in found:
        glu = name.endswith("linear_fc1") and base.config.gated_linear_unit
        expert = _LOCAL_EXPERT.fullmatch(name) is not None
        base.adapter = LoRAAdapter(base, spec, key, column, glu, expert)
        base.adapter.hook = base.register_forward_hook(_add_adapter_term)
        base.sharded_state_dict = functools.partial(_sharded_state_dict, base)
    return [name for name, *_ in found]


def adapter_delta(adapter: LoRAAdapter) -> torch.Tensor:
    """``(alpha/rank) * B @ A`` of this rank's pieces, fp32, shaped like the base's local weight
    (a column-parallel base's local rows, a row-parallel one's local columns)."""
    return adapter.scale * (adapter.lora_b.detach().float() @ adapter.lora_a.detach().float())


def merged_weight(weight: torch.Tensor, adapter: LoRAAdapter) -> torch.Tensor:
    """A new tensor ``W + (alpha/rank) * B @ A`` (summed in fp32, rounded once to ``W``'s
    dtype) of this rank's piece of the base weight; ``weight`` itself is left as it is."""
    return (weight.detach().float() + adapter_delta(adapter)).to(weight.dtype)


@torch.no_grad()
def merge_adapters(model) -> int:
    """Fold every adapter into its base weight, ``W += (alpha/rank) * B @ A`` on this rank's
    pieces (a column-parallel base's local rows, a row-parallel one's local columns: no
    communication), remove the adapters and make every parameter trainable again: a plain model
    computing what the adapted one did (to rounding). Returns how many were merged."""
    merged = 0
    for name, module in list(model.named_modules()):
        adapter = getattr(module, "adapter", None)
        if not isinstance(adapter, LoRAAdapter):
            continue
        module.weight.add_(adapter_delta(adapter).to(module.weight.dtype))
        adapter.hook.remove()
        del module.adapter
        del module.sharded_state_dict  # the class's own again
        merged += 1
    for param in model.parameters():
        param.requires_grad_(True)
    return merged


def adapters(model):
    """(stage-local name of the base linear, its :class:`LoRAAdapter`) for every adapter."""
    for name, module in model.named_modules():
        if isinstance(module, LoRAAdapter):
            yield name.rsplit(".", 1)[0], module


@contextlib.contextmanager
def adapters_disabled(model):
    """Within this block ``model`` computes its base (e.g. PPO's reference policy), exactly."""
    held = [adapter for _, adapter in adapters(model)]
    states = [adapter.enabled for adapter in held]
    for adapter in held:
        adapter.enabled = False
    try:
        yield model
    finally:
        for adapter, state in zip(held, states):
            adapter.enabled = state
