"""CPU platform layer: the one place where megatron-core's CUDA assumptions are bridged.

megatron-core 0.16.1 assumes a GPU in ways no config flag turns off:

1. buffers allocated with ``device=torch.cuda.current_device()`` (attention, rotary, TP mappings);
2. the model-parallel RNG tracker reads and writes the CUDA generator, and attention always forks it;
3. hard-coded ``device="cuda"`` tensors in pipeline schedules, optimizer, grad scaler, mask helpers;
4. ``torch.cuda.synchronize`` in batched p2p and DDP;
5. ``.cuda()`` on tied embedding weights when PP > 1;
6. (not bridged: sequence parallel with the torch-norm fallback; layouts reject it on CPU);
7. DistributedOptimizer / bf16 optimizers checking ``param.type() == 'torch.cuda.FloatTensor'``.

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


def _patch(owner: Any, name: str, value: Callable) -> None:
    _STATE.patches.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def _cpu_get_rng_state(*_args, **_kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *_args, **_kwargs) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    torch.random.default_generator.manual_seed(int(seed))


def _no_op(*_args, **_kwargs) -> None:
    return None


def apply_platform() -> bool:
    """Install the CPU bridge once per process; a no-op when CUDA is available.

    Returns True when the bridge is (now or already) active.
    """
    with _LOCK:
        if _STATE.applied:
            return True
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
        _STATE.mode = CudaToCpuMode()
        _STATE.mode.__enter__()
        _STATE.applied = True
        return True


def remove_platform() -> None:
    """Undo :func:`apply_platform` (used by tests that check the GPU path is untouched)."""
    with _LOCK:
        if _STATE.mode is not None:
            _STATE.mode.__exit__(None, None, None)
            _STATE.mode = None
        for owner, name, original in reversed(_STATE.patches):
            setattr(owner, name, original)
        _STATE.patches.clear()
        _STATE.applied = False
