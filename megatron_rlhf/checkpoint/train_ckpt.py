"""Training checkpoints: model + optimizer + scheduler + data position + RNG, saved atomically.

``RUN/checkpoints/step_00000042/`` is a complete model checkpoint (see :mod:`model_ckpt`, so
``megatron-rlhf convert mcore-to-hf`` exports it) plus ``trainer_state.json`` and per-rank RNG
states. It is written as ``step_00000042.partial`` and committed (renamed) only when every rank
has finished writing; the metadata file is written last, so a folder without it is never taken
for a checkpoint, and older checkpoints are pruned only after the new one is committed. With
``async_save`` the shards are written by a background process (megatron-core's asynchronous
``dist_checkpointing`` save) while training goes on, and the commit happens at a later step
boundary, once every rank's writer has finished.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_rlhf.checkpoint.model_ckpt import (META_FILE, FORMAT_VERSION, dtype_name, read_sharded,
                                                start_writer_queue)
from megatron_rlhf.checkpoint.safe_load import (LEGACY_RNG_GLOBALS, RefusedCheckpointFile,
                                                 load_torch_file)
from megatron_rlhf.errors import UserError

PREFIX = "step_"
_UNFINISHED = (".partial", ".stale")  # a save in progress; a replaced checkpoint being deleted


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)
             and not p.name.endswith(_UNFINISHED) and (p / META_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def remove_unfinished(root: str | os.PathLike) -> list[Path]:
    """Delete what killed saves left under ``root`` (``*.partial``, ``*.stale``); returns them.
    Call only when no save of this run is in flight."""
    root = Path(root)
    found = [p for p in root.glob(f"{PREFIX}*") if p.is_dir() and p.name.endswith(_UNFINISHED)] \
        if root.is_dir() else []
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    return found


def _rng_state() -> dict:
    """Every generator the trainers draw from, as tensors and plain values only, so that
    ``torch.load(weights_only=True)`` reads it back."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    numpy_state = np.random.get_state(legacy=False)
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": {"bit_generator": numpy_state["bit_generator"],
                      "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
                      "pos": int(numpy_state["state"]["pos"]),
                      "has_gauss": int(numpy_state["has_gauss"]),
                      "gauss": float(numpy_state["gauss"])},
            "tracker": get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    saved = state["numpy"]
    if isinstance(saved, dict):
        np.random.set_state({"bit_generator": saved["bit_generator"],
                             "state": {"key": saved["key"].numpy().astype(np.uint32),
                                       "pos": saved["pos"]},
                             "has_gauss": saved["has_gauss"], "gauss": saved["gauss"]})
    else:  # written before the tensor format: numpy's own legacy tuple
        np.random.set_state(saved)
    get_cuda_rng_tracker().set_states(state["tracker"])


# megatron-core 0.16.1's default distributed-optimizer format (fully_sharded_model_space) is
# refused by its own torch_dist writer ("flattened_range is not supported"); fully_reshardable
# also lets a resume change TP/PP/EP, not only DP. MoE models at EP > 1 chain a second optimizer
# for the experts: without the chain's key prefix its state is keyed by parameter, so it loads
# into EP = 1's single optimizer too.
_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable",
                     "chained_optim_avoid_prefix": True}


def _sharded_state(trainable, loading: bool) -> dict:
    model_state = trainable.module.sharded_state_dict()
    return {"model": model_state,
            "optimizer": trainable.optimizer.sharded_state_dict(model_state, is_loading=loading,
                                                                metadata=_OPTIMIZER_FORMAT)}


def _optimizer_count(trainable) -> int:
    return len(getattr(trainable.optimizer, "chained_optimizers", None) or [trainable.optimizer])


class CheckpointWriter:
    """Saves one model's training checkpoints under ``root`` (collective calls, every rank).

    ``keep_last_n`` prunes after each commit (``None``: the caller prunes, e.g. once every model
    of a multi-model run has committed). With ``async_save`` :meth:`save` returns once the
    shards are handed to a background writer; :meth:`finalize` (at step boundaries, on every
    rank) commits it once every rank's writer is done. One save is in flight at a time.
    """

    def __init__(self, root: str | os.PathLike, trainable, meta: dict, hf_config,
                 tokenizer, keep_last_n: int | None, async_save: bool = False):
        self.root, self.trainable, self.meta = Path(root), trainable, meta
        self.hf_config, self.tokenizer = hf_config, tokenizer
        self.keep_last_n, self.async_save = keep_last_n, async_save
        self.queue = None  # megatron's AsyncCallsQueue, made at the first asynchronous save
        self.pending: tuple | None = None  # (step, partial folder, state, started) in flight
        self.seconds = 0.0  # how long the last save blocked training
        self.committed: list[tuple[int, float]] = []  # (step, seconds from start to commit)

    def save(self, step: int, trainer_state: dict) -> Path:
        """Write checkpoint ``step``; returns its final folder (committed already unless
        asynchronous)."""
        from megatron.core import dist_checkpointing

        self._drain(blocking=True)  # the previous save first: one in flight
        started = time.perf_counter()
        out = self.root / f"{PREFIX}{step:08d}"
        partial = out.with_name(out.name + ".partial")
        rank = dist.get_rank()
        if rank == 0:
            remove_unfinished(self.root)  # left by killed saves; none of ours is in flight
            (partial / "model").mkdir(parents=True)
            (partial / "rng").mkdir()
            self.hf_config.save_pretrained(partial / "hf")
            self.tokenizer.save_pretrained(partial / "hf")
        dist.barrier()
        # The RNG files are small and must hold the state of this moment, not of the commit.
        torch.save(_rng_state(), partial / "rng" / f"rank_{rank:05d}.pt")
        state = {**trainer_state, "scheduler": self.trainable.scheduler.state_dict(),
                 "optimizers": _optimizer_count(self.trainable)}
        start_writer_queue()
        request = dist_checkpointing.save(_sharded_state(self.trainable, loading=False),
                                          str(partial / "model"),
                                          async_sharded_save=self.async_save)
        self.pending = (step, partial, state, started)
        if request is None:
            self._commit()
        else:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            request.add_finalize_fn(self._commit)
            self.queue = self.queue or AsyncCallsQueue()
            self.queue.schedule_async_request(request)
        self.seconds = time.perf_counter() - started
        return out

    def finalize(self, blocking: bool = False) -> list[tuple[int, float]]:
        """Commit a finished asynchronous save (``blocking``: wait for it); returns the
        ``(step, seconds)`` committed since the last call. Every rank calls it at the same
        point: megatron's completion check is a collective."""
        self._drain(blocking)
        done, self.committed = self.committed, []
        return done

    def _drain(self, blocking: bool) -> None:
        if self.queue is not None and self.pending is not None:
            self.queue.maybe_finalize_async_calls(blocking=blocking)

    def close(self) -> None:
        """Commit what is in flight and stop megatron's writer."""
        self.finalize(blocking=True)
        if self.queue is not None:
            self.queue.close()
            self.queue = None

    def _commit(self) -> None:
        """Every rank's shards are written: state and metadata (last), then the rename, then
        the pruning. An existing folder of the same step (one a resume abandoned) is moved
        aside first and deleted after, so no instant lacks both."""
        step, partial, state, started = self.pending
        dist.barrier()  # every rank's RNG file and shards are on disk
        if dist.get_rank() == 0:
            out = partial.with_name(partial.name[:-len(".partial")])
            (partial / "trainer_state.json").write_text(json.dumps(state, indent=2))
            full_meta = {"format_version": FORMAT_VERSION, **self.meta,
                         "dtype": dtype_name(self.trainable.module.config.params_dtype)}
            (partial / META_FILE).write_text(json.dumps(full_meta, indent=2))
            stale = out.with_name(out.name + ".stale")
            if out.exists():
                os.replace(out, stale)
            os.replace(partial, out)
            shutil.rmtree(stale, ignore_errors=True)
            if self.keep_last_n:
                for old in complete_checkpoints(self.root)[:-self.keep_last_n]:
                    shutil.rmtree(old)
        dist.barrier()
        self.pending = None
        self.committed.append((step, time.perf_counter() - started))


def read_checkpoint_files(path: str | os.PathLike) -> tuple[dict, dict | None]:
    """``trainer_state.json`` and this rank's RNG state (None when saved by another world
    size), read before anything collective so that a rank failing here can be agreed on.
    The RNG file is read with ``weights_only=True`` (older ones: numpy's arrays admitted too)."""
    path = Path(path)
    try:
        state = json.loads((path / "trainer_state.json").read_text())
        if not isinstance(state, dict) or not {"step", "scheduler"} <= state.keys():
            raise ValueError("no 'step' and 'scheduler' entries")
    except (OSError, ValueError) as err:
        raise UserError(f"checkpoint {path}: trainer state cannot be read "
                        f"({type(err).__name__}: {err})") from None
    rng_file = path / "rng" / f"rank_{dist.get_rank():05d}.pt"
    try:
        rng = load_torch_file(rng_file, LEGACY_RNG_GLOBALS) if rng_file.is_file() else None
    except RefusedCheckpointFile:
        raise
    except UserError as err:
        raise UserError(f"checkpoint {path}: trainer state cannot be read ({err})") from None
    if rng is not None and not (isinstance(rng, dict) and {"torch", "python", "numpy",
                                                            "tracker"} <= rng.keys()):
        raise UserError(f"{rng_file}: not an RNG state (keys {sorted(rng)[:6]})"
                        if isinstance(rng, dict) else f"{rng_file}: not an RNG state")
    return state, rng


def load_train_checkpoint(path: str | os.PathLike, trainable,
                          files: tuple[dict, dict | None] | None = None) -> dict:
    """Restore model, optimizer, scheduler and this rank's RNG; return the trainer state.
    ``files``: :func:`read_checkpoint_files`' result, if already read."""
    path = Path(path)
    state, rng = files or read_checkpoint_files(path)
    state = dict(state)
    saved, now = state.pop("optimizers", 1), _optimizer_count(trainable)
    if saved != now:
        raise UserError(f"checkpoint {path} holds the state of {saved} chained optimizer(s) and this "
                        f"layout builds {now} (expert parallelism gives the experts their own): "
                        "training state cannot move across that change; start a new run from "
                        "its weights instead (model.path / actor.model_path = the checkpoint)")
    loaded = read_sharded(_sharded_state(trainable, loading=True), path)
    trainable.module.load_state_dict(loaded["model"])
    trainable.optimizer.load_state_dict(loaded["optimizer"])
    # megatron-core's load_state_dict *adds* the saved step count (step(increment=saved)): a
    # scheduler that already stepped (a rollback mid-run) would jump ahead without this reset.
    trainable.scheduler.num_steps = 0
    trainable.scheduler.load_state_dict(state.pop("scheduler"))
    if rng is not None:
        _set_rng_state(rng)
    return state


def check_checkpoint_files(path: str | os.PathLike) -> None:
    """Every pickled file of a megatron_rlhf checkpoint folder (model and RNG states) through
    the restricted readers, without loading anything: a driver checks what its workers will
    open before it books them. A folder that is not such a checkpoint (an HF folder) passes."""
    from megatron_rlhf.checkpoint.safe_load import check_torch_dist

    path = Path(path)
    if not (path / META_FILE).is_file():
        return
    check_torch_dist(path / "model")
    for rng_file in sorted((path / "rng").glob("rank_*.pt")) if (path / "rng").is_dir() else []:
        load_torch_file(rng_file, LEGACY_RNG_GLOBALS)
