"""CPU platform layer: the one place where megatron-core's CUDA assumptions are bridged.

megatron-core 0.16.1 assumes a GPU in ways no config flag turns off:

1. buffers allocated with ``device=torch.cuda.current_device()`` (attention, rotary, TP mappings);
2. the model-parallel RNG tracker reads and writes the CUDA generator, and attention always forks it;
3. hard-coded ``device="cuda"`` tensors in pipeline schedules, optimizer, grad scaler, mask helpers;
4. ``torch.cuda.synchronize`` in batched p2p and DDP;
5. ``.cuda()`` on tied embedding weights when PP > 1;
6. the torch-norm fallback refusing sequence parallel (bridged with the no-TE fixes below);
7. DistributedOptimizer / bf16 optimizers checking ``param.type() == 'torch.cuda.FloatTensor'``;
8. the device mapping is a ``TorchFunctionMode``, and the autograd engine runs a custom
   ``autograd.Function.backward`` without the caller's modes: expert-parallel all-to-all,
   sequence-parallel gathers and activation recompute ask for the CUDA device there;
9. CUDA streams and events (MoE all-to-all dispatcher, shared-expert overlap): on CPU every op is
   synchronous, so they become no-ops;
10. MoE split sizes meant for ``all_to_all_single`` reach it as numpy only from a GPU;
11. YaRN rotary embeddings (MLA) enter ``torch.device(torch.cuda.current_device())`` unless told
    to initialise on the CPU, which MLA never does;
12. ``megatron.core.jit.jit_fuser`` is ``torch.compile``, applied to fusable functions as
    megatron-core imports: the import alone pulls in TorchDynamo and Inductor (about 2 s of every
    process's start on a 2-core machine), and compiling for the CPU would need a C++ toolchain.
    On CPU megatron-core is imported with its fuser as the identity, so those functions run eagerly
    (:func:`_import_megatron_eagerly`).

Without Transformer Engine (any device) megatron-core 0.16.1's local layers have bugs of their
own, fixed by :func:`apply_no_te_fixes` (each fix names the error it prevents).

On CPU the "device" is the CPU: the device RNG is the CPU default generator, every CUDA device
request becomes a CPU one, synchronisation is a no-op. :func:`apply_platform` installs all of it
once, and only when CUDA is absent; on a GPU machine it returns without touching anything, so the
production path runs megatron-core unmodified.

The device mapping is a ``TorchFunctionMode``: every torch call of the process pays a Python
round trip for it. Code that runs no megatron-core (the rollout engine's transformers decode loop,
thousands of tiny ops per batch) opts out with :func:`bridge_suspended`.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

_LOCK = threading.Lock()


@dataclass
class _PlatformState:
    applied: bool = False
    # (owner object, attribute name, original value) for every patch, so tests can undo them.
    patches: list[tuple[Any, str, Any]] = field(default_factory=list)
    mode: TorchFunctionMode | None = None


_STATE = _PlatformState()


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is megatron's `torch.cuda.current_device()`: a CUDA ordinal.
    return isinstance(device, int) and not isinstance(device, bool)


_CPU = torch.device("cpu")


class CudaToCpuMode(TorchFunctionMode):
    """Maps every CUDA device request of a torch call to the CPU (items 1, 3, 5 and 7 above)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Item 7: optimizers compare `param.type()` with CUDA type names.
            return func(*args).replace("torch.", "torch.cuda.", 1)
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def platform_is_cpu() -> bool:
    """True when this process has no usable CUDA device (the bridge is needed)."""
    return not torch.cuda.is_available()


def device() -> torch.device:
    """The device tensors of this process live on: the local GPU, or the CPU."""
    if platform_is_cpu():
        return _CPU
    return torch.device("cuda", torch.cuda.current_device())


@contextmanager
def bridge_suspended():
    """Run plain-torch code without the device-mapping mode (a no-op where none is installed).

    Only for code that makes no CUDA request: inside, ``device="cuda"`` means CUDA again. The
    mode is set aside only when it is the innermost one, so any mode entered after it stays.
    """
    from torch.overrides import _get_current_function_mode

    mode = _STATE.mode
    if mode is None or _get_current_function_mode() is not mode:
        yield
        return
    mode.__exit__(None, None, None)
    try:
        yield
    finally:
        mode.__enter__()


_ABSENT = object()


def _patch(owner: Any, name: str, value: Any) -> None:
    _STATE.patches.append((owner, name, getattr(owner, name, _ABSENT)))
    setattr(owner, name, value)


def _cpu_get_rng_state(*_args, **_kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *_args, **_kwargs) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    torch.random.default_generator.manual_seed(int(seed))


def _no_op(*_args, **_kwargs) -> None:
    return None


class _CpuEvent:
    def record(self, stream=None):
        return None

    def wait(self, stream=None):
        return None

    def synchronize(self):
        return None

    def query(self) -> bool:
        return True


class _CpuStream:
    """``torch.cuda.Stream`` on CPU, where work is synchronous: every stream op is a no-op."""

    def __init__(self, *_args, **_kwargs):
        pass

    def wait_stream(self, _other):
        return None

    def wait_event(self, _event):
        return None

    def record_event(self, event=None):
        return event or _CpuEvent()

    def synchronize(self):
        return None

    def __eq__(self, other):
        return isinstance(other, _CpuStream)

    def __hash__(self):
        return 0


_CPU_STREAM = _CpuStream()


def _backward_in_mode(original: Callable) -> Callable:
    """Item 8: re-enter the device mapping around every custom ``Function.backward``.

    Without it megatron's ``_AllToAll.backward`` (expert parallelism), the sequence-parallel
    gathers' backward and recompute's ``CheckpointFunction.backward`` fail with
    ``RuntimeError: Cannot access accelerator device when none is available``.
    """
    from torch.overrides import _get_current_function_mode_stack

    def apply(self, *args):
        mode = _STATE.mode
        if mode is None or mode in _get_current_function_mode_stack():
            return original(self, *args)
        with mode:
            return original(self, *args)

    return apply


def _numpy_split_sizes(original: Callable) -> Callable:
    """Item 10: ``maybe_move_tensor_to_cpu(t, as_numpy=True)`` leaves a CPU tensor a tensor, and
    ``all_to_all_single`` then raises ``TypeError: incompatible function arguments``."""

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        out = original(tensor, as_numpy=as_numpy, record_stream=record_stream)
        return out.numpy() if as_numpy and torch.is_tensor(out) else out

    return maybe_move_tensor_to_cpu


def _cpu_initialised(original: Callable) -> Callable:
    """Item 11: ``torch.device(0)`` raises ``Cannot access accelerator device`` without CUDA."""

    def init(self, *args, **kwargs):
        kwargs["use_cpu_initialization"] = True
        original(self, *args, **kwargs)

    return init


def _apply_cpu_bridges() -> None:
    import contextlib

    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    from torch.autograd.function import BackwardCFunction

    _patch(BackwardCFunction, "apply", _backward_in_mode(BackwardCFunction.apply))
    _patch(torch.cuda, "Stream", _CpuStream)
    _patch(torch.cuda, "Event", _CpuEvent)
    _patch(torch.cuda, "current_stream", lambda *_a, **_k: _CPU_STREAM)
    _patch(torch.cuda, "stream", lambda *_a, **_k: contextlib.nullcontext())
    _patch(YarnRotaryEmbedding, "__init__", _cpu_initialised(YarnRotaryEmbedding.__init__))
    moved = _numpy_split_sizes(moe_utils.maybe_move_tensor_to_cpu)
    _patch(moe_utils, "maybe_move_tensor_to_cpu", moved)
    _patch(token_dispatcher, "maybe_move_tensor_to_cpu", moved)


def has_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def apply_no_te_fixes() -> None:
    """megatron-core 0.16.1's local (non-Transformer-Engine) layers, on any device."""
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    # moe_utils binds te_general_gemm only when TE imports, yet the router tests it
    # unconditionally: `NameError: name 'te_general_gemm' is not defined` on the first forward.
    if not hasattr(moe_utils, "te_general_gemm"):
        _patch(moe_utils, "te_general_gemm", None)
    # Without TE, megatron's TE extension still imports (TE is a MagicMock there), so MLA sets
    # HAVE_TE=True and `isinstance(x, TELinear)` raises `TypeError: isinstance() arg 2 must be a
    # type` while building MLASelfAttention.
    _patch(multi_latent_attention, "HAVE_TE", False)
    # CheckpointWithoutOutput(fp8=False) sets `self.fp8 = fp8 is not None`, i.e. True, and its
    # forward then calls TE's FP8GlobalStateManager: `NameError` in selective recompute.
    checkpoint = mcore_random.CheckpointWithoutOutput
    init = checkpoint.__init__

    def checkpoint_init(self, fp8=False):
        init(self, fp8=fp8)
        self.fp8 = bool(fp8)

    _patch(checkpoint, "__init__", checkpoint_init)
    # The torch-norm fallback asserts `not sequence_parallel`. Under SP a norm just runs on the
    # local sequence shard; its weight gradients are all-reduced over TP by
    # finalize_model_grads for parameters tagged `sequence_parallel`.
    new = WrappedTorchNorm.__new__

    def norm_new(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        sp = config.sequence_parallel
        config.sequence_parallel = False
        try:
            norm = new(cls, config, hidden_size, eps, *args, **kwargs)
        finally:
            config.sequence_parallel = sp
        for param in norm.parameters():
            param.sequence_parallel = sp
        return norm

    _patch(WrappedTorchNorm, "__new__", staticmethod(norm_new))
    _fresh_adam_state_for_loading()
    _mla_rotary_key_gradient()


class _GatherKeyDown(torch.autograd.Function):
    """All-gather of MLA's key down projection over TP (last dim, ``[kv_lora_rank | rope]``);
    backward sums the rotary columns' gradient over TP before keeping this rank's columns."""

    @staticmethod
    def forward(ctx, x, group, rope: int):
        from megatron.core.tensor_parallel import mappings

        ctx.group, ctx.rope = group, rope
        return mappings._gather_along_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        from megatron.core.tensor_parallel import mappings

        rotary = grad[..., -ctx.rope:].contiguous()
        torch.distributed.all_reduce(rotary, group=ctx.group)
        grad = torch.cat([grad[..., :-ctx.rope], rotary], dim=-1)
        return mappings._split_along_last_dim(grad, ctx.group), None, None


def _mla_rotary_key_gradient() -> None:
    """megatron-core 0.16.1's local MLA spec (ColumnParallelLinear down projections) at TP > 1
    gathers the key's down projection over TP and splits off its rotary part ``k_pos_emb``,
    which each rank's own heads then use: its gradient on a rank is that rank's heads' share,
    yet the gather's backward keeps this rank's columns of it and drops the rest (the TE spec
    uses a duplicated linear there and reduce-scatters ``k_pos_emb``'s gradient). Measured on
    tiny DeepSeek-V3 at TP2: the key down projection's adapter gradients 1% off TP1's after one
    step. That one gather sums the rotary columns' gradient over TP first."""
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer import multi_latent_attention as mla

    current = threading.local()
    gather = mla.gather_from_tensor_model_parallel_region
    key_value = mla.MLASelfAttention.get_query_key_value_tensors

    def gather_in_mla(input_, group=None):
        attention = getattr(current, "attention", None)
        group = mappings.get_tensor_model_parallel_group_if_none(group)
        if attention is None:
            return gather(input_, group)
        current.calls += 1
        cfg = attention.config
        # The query's gather (when q_lora_rank is set) comes first, the key's second.
        key = cfg.q_lora_rank is None or current.calls == 2
        if key and input_.size(-1) * group.size() == cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim:
            return _GatherKeyDown.apply(input_, group, cfg.qk_pos_emb_head_dim)
        return gather(input_, group)

    def key_value_tensors(self, *args, **kwargs):
        current.attention, current.calls = self, 0
        try:
            return key_value(self, *args, **kwargs)
        finally:
            current.attention = None

    _patch(mla, "gather_from_tensor_model_parallel_region", gather_in_mla)
    _patch(mla.MLASelfAttention, "get_query_key_value_tensors", key_value_tensors)


def _fresh_adam_state_for_loading() -> None:
    """Without apex/TE the distributed optimizer wraps torch's Adam and reads the step count
    from its per-parameter state, which a fresh optimizer does not have yet: resuming into one
    fails with ``assert len(steps) == 1`` in ``DistributedOptimizer.state_dict`` (the load asks
    for the state dict first). Give an empty optimizer Adam's own zero state (what its first
    step would create, step 0), which the load then overwrites. The load itself then puts the
    saved step into that state and copies every state tensor from the checkpoint's, which has no
    'step' (it travels in the param groups): ``KeyError: 'step'`` in
    ``_set_main_param_and_optimizer_states``; the step already set is kept instead, one tensor
    per parameter."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    original = distrib_optimizer.DistributedOptimizer.state_dict

    def state_dict(self):
        inner = self.optimizer
        if not inner.state:
            for group in inner.param_groups:
                for param in group["params"]:
                    inner.state[param] = {"step": torch.tensor(0.0),
                                          "exp_avg": torch.zeros_like(param),
                                          "exp_avg_sq": torch.zeros_like(param)}
        return original(self)

    _patch(distrib_optimizer.DistributedOptimizer, "state_dict", state_dict)
    set_states = distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states_keeping_step(self, model_param, tensors):
        group, order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
        if "step" in state and "step" not in tensors:
            # The load gave every parameter the same step tensor, which torch's Adam would then
            # advance once per parameter (wrong bias corrections from the next step on).
            state["step"] = state["step"].detach().clone()
            tensors = {**tensors, "step": state["step"]}
        return set_states(self, model_param, tensors)

    _patch(distrib_optimizer.DistributedOptimizer, "_set_main_param_and_optimizer_states",
           set_states_keeping_step)


def _import_megatron_eagerly() -> None:
    """megatron-core's fuser as the identity: its first import runs with ``torch.compile`` as the
    identity (``jit_fuser`` is bound once, in ``megatron.core.jit``, and applied as modules load),
    and ``jit_fuser`` stays the identity for whatever imports it later. Its optional ``wandb``
    import (inference contexts' logging, 0.6 s) is skipped the same way; our own wandb logger
    imports it when asked."""
    import sys

    if "megatron.core" not in sys.modules:
        compile_ = torch.compile
        hid_wandb = "wandb" not in sys.modules
        if hid_wandb:
            sys.modules["wandb"] = None  # `import wandb` raises ImportError: megatron's fallback
        torch.compile = lambda model=None, **_kw: model if model is not None else (lambda fn: fn)
        try:
            import megatron.core  # noqa: F401
        finally:
            torch.compile = compile_
            if hid_wandb and sys.modules.get("wandb", 0) is None:
                del sys.modules["wandb"]
    import megatron.core.jit as mcore_jit

    _patch(mcore_jit, "jit_fuser", mcore_jit.noop_decorator)


def apply_platform() -> bool:
    """Install the CPU bridge once per process (a no-op when CUDA is available), and the fixes
    for megatron-core's local layers when Transformer Engine is absent.

    Returns True when the CPU bridge is (now or already) active.
    """
    with _LOCK:
        if _STATE.applied:
            return _STATE.mode is not None
        _STATE.applied = True
        if platform_is_cpu():
            _import_megatron_eagerly()
        if not has_transformer_engine():
            apply_no_te_fixes()
        if not platform_is_cpu():
            return False
        from megatron.core.tensor_parallel import random as mcore_random

        _patch(torch.cuda, "current_device", lambda: 0)
        _patch(torch.cuda, "synchronize", _no_op)
        _patch(torch.cuda, "get_rng_state", _cpu_get_rng_state)
        _patch(torch.cuda, "set_rng_state", _cpu_set_rng_state)
        _patch(torch.cuda, "manual_seed", _cpu_manual_seed)
        _patch(torch.cuda, "manual_seed_all", _cpu_manual_seed)
        _patch(torch.cuda.random, "get_rng_state", _cpu_get_rng_state)
        _patch(mcore_random, "_get_cuda_rng_state", _cpu_get_rng_state)
        _patch(mcore_random, "_set_cuda_rng_state", _cpu_set_rng_state)
        _apply_cpu_bridges()
        _STATE.mode = CudaToCpuMode()
        _STATE.mode.__enter__()
        return True


def remove_platform() -> None:
    """Undo :func:`apply_platform` (used by tests that check the GPU path is untouched)."""
    with _LOCK:
        if _STATE.mode is not None:
            _STATE.mode.__exit__(None, None, None)
            _STATE.mode = None
        for owner, name, original in reversed(_STATE.patches):
            if original is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        _STATE.patches.clear()
        _STATE.applied = False
