"""A model's state to host memory and back, while something else needs the device (colocated
offload: the trainer steps aside while the rollout engine generates).

The unit moved is a *storage*, not a tensor: megatron DDP's parameters are views of one
contiguous parameter buffer (with the distributed optimizer), its ``main_grad`` s views of one
gradient buffer, the distributed optimizer's fp32 shards views of either, and an fp32 model's
optimizer main weights are the parameters themselves. Each storage is copied to ONE host
buffer, allocated at its first offload and reused ever after (pinned when CUDA is available),
and then resized to 0 bytes in place (``untyped_storage().resize_(0)``): every tensor and view
onto it (``param.data``, ``bucket.param_data``, ``param.main_grad``, the optimizer's shards)
keeps its identity, shape and strides, and is whole again after :meth:`Offloader.reload`
(``resize_`` back + ``copy_``). The round trip is bitwise. On CPU the "device" is the host too:
the host buffer is then a second CPU tensor and the original storage is still freed.

Three parts (``actor.offload`` / ``critic.offload`` / ``actor.ref_offload`` /
``reward.offload``): ``params`` (parameters and module buffers), ``grads`` (DDP's gradient
buffers, any other ``main_grad`` / ``.grad``), ``optimizer`` (the torch optimizer's main weights
and its per-parameter state, Adam's moments). A storage that belongs to two parts goes with the
first in that order: an fp32 model's main weights are its parameters and move with ``params``.
Only storages on the model's device move (on GPU, torch's Adam ``step`` counters stay on the
host where torch keeps them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

PARTS = ("params", "grads", "optimizer")


@dataclass
class Moved:
    """What one :meth:`Offloader.offload` or :meth:`Offloader.reload` moved."""

    bytes: int = 0
    seconds: float = 0.0

    def __add__(self, other: "Moved") -> "Moved":
        return Moved(self.bytes + other.bytes, self.seconds + other.seconds)


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A ``uint8`` tensor over the whole of ``storage`` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Offloader:
    """Moves the storages of one model (and its DDP buffers and optimizer, when trainable)
    between the device and host buffers of its own.

    ``module``: the model (a megatron DDP's ``.module``, or a frozen model); ``ddp``: megatron
    ``DistributedDataParallel`` (``buffers``, ``expert_parallel_buffers``) or None; ``optimizer``:
    a megatron optimizer (plain, distributed or chained) or None. Both calls are idempotent: a
    part already out (in) is left alone.
    """

    def __init__(self, module, ddp=None, optimizer=None):
        self.module, self.ddp, self.optimizer = module, ddp, optimizer
        self.device = next(module.parameters()).device
        # storage id -> (the storage, its host buffer made once); the reference keeps the id from
        # being reused by another storage
        self.host: dict[int, tuple[torch.UntypedStorage, torch.Tensor]] = {}
        self.out: dict[str, list[tuple[torch.UntypedStorage, torch.Tensor]]] = {}

    @classmethod
    def of(cls, model) -> "Offloader":
        """For a ``Trainable`` (anything with ``model``, ``module`` and ``optimizer``) or a
        frozen ``torch.nn.Module``."""
        if isinstance(model, torch.nn.Module):
            return cls(model)
        return cls(model.module, model.model, model.optimizer)

    # ------------------------------------------------------------------ what belongs to a part
    def _tensors(self, part: str) -> Iterator[torch.Tensor]:
        if part == "params":
            yield from self.module.parameters()
            yield from (b for b in self.module.buffers() if b is not None)
        elif part == "grads":
            if self.ddp is not None:
                for buffer in self.ddp.buffers + self.ddp.expert_parallel_buffers:
                    yield buffer.grad_data
            for param in self.module.parameters():
                yield from (t for t in (getattr(param, "main_grad", None), param.grad) if t is not None)
            for param in self._main_params():
                if param.grad is not None:
                    yield param.grad
        elif part == "optimizer":
            for inner in self._torch_optimizers():
                for group in inner.param_groups:
                    yield from group["params"]
                for state in inner.state.values():
                    yield from (v for v in state.values() if torch.is_tensor(v))
        else:
            raise ValueError(f"offload part {part!r} is none of {PARTS}")

    def _torch_optimizers(self) -> list:
        if self.optimizer is None:
            return []
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return [o.optimizer for o in chained if getattr(o, "optimizer", None) is not None]

    def _main_params(self) -> Iterable[torch.Tensor]:
        return (p for inner in self._torch_optimizers() for g in inner.param_groups for p in g["params"])

    def storages(self, part: str) -> list[torch.UntypedStorage]:
        """The device storages of ``part``, each once, none that an earlier part owns."""
        earlier = {s._cdata for p in PARTS[:PARTS.index(part)] for s in self._own(p)}
        return [s for s in self._own(part) if s._cdata not in earlier]

    def _own(self, part: str) -> list[torch.UntypedStorage]:
        found: dict[int, torch.UntypedStorage] = {}
        for tensor in self._tensors(part):
            storage = tensor.untyped_storage()
            if storage.device.type == self.device.type:
                found.setdefault(storage._cdata, storage)
        return list(found.values())

    # ------------------------------------------------------------------ moving
    def offload(self, params: bool = False, grads: bool = False, optimizer: bool = False) -> Moved:
        """Copy the chosen parts to their host buffers and free their device storage."""
        moved = Moved()
        for part, wanted in zip(PARTS, (params, grads, optimizer)):
            if wanted and part not in self.out:
                moved += self._offload(part)
        return moved

    def reload(self, params: bool = False, grads: bool = False, optimizer: bool = False) -> Moved:
        """Re-allocate the chosen parts' device storage and copy their bytes back."""
        moved = Moved()
        for part, wanted in zip(PARTS, (params, grads, optimizer)):
            if wanted and part in self.out:
                moved += self._reload(part)
        return moved

    def _offload(self, part: str) -> Moved:
        start, total, entries = time.perf_counter(), 0, []
        for storage in self.storages(part):
            size = storage.nbytes()
            if size == 0:
                continue  # an empty tensor: nothing to hold
            if not storage.resizable():
                raise RuntimeError(f"offload: a {part} storage of {size} bytes cannot be resized "
                                   "(memory-mapped or borrowed); it cannot be offloaded")
            if storage._cdata not in self.host:
                self.host[storage._cdata] = (storage, torch.empty(
                    size, dtype=torch.uint8, pin_memory=torch.cuda.is_available()))
            host = self.host[storage._cdata][1]
            if host.numel() != size:
                raise RuntimeError(f"offload: a {part} storage changed size ({host.numel()} -> "
                                   f"{size} bytes) since it was first offloaded")
            host.copy_(_as_bytes(storage))
            entries.append((storage, host))
            total += size
        _synchronize(self.device)
        for storage, _ in entries:
            storage.resize_(0)
        self.out[part] = entries
        return Moved(total, time.perf_counter() - start)

    def _reload(self, part: str) -> Moved:
        start, total = time.perf_counter(), 0
        for storage, host in self.out.pop(part):
            storage.resize_(host.numel())
            _as_bytes(storage).copy_(host)
            total += host.numel()
        _synchronize(self.device)
        return Moved(total, time.perf_counter() - start)

    def resident_bytes(self, part: str) -> int:
        """Device bytes ``part`` holds now (0 while offloaded)."""
        return sum(s.nbytes() for s in self.storages(part))

    def host_buffers(self) -> dict[int, Any]:
        """storage id -> host buffer address: equal from step to step (allocated once)."""
        return {key: host.data_ptr() for key, (_, host) in self.host.items()}
