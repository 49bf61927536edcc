"""Training checkpoints: model + optimizer + scheduler + data position + RNG, saved atomically.

``RUN/checkpoints/step_00000042/`` is a complete model checkpoint (see :mod:`model_ckpt`, so
``megatron-rlhf convert mcore-to-hf`` exports it) plus ``trainer_state.json`` and per-rank RNG
states. It is written as ``step_00000042.partial`` and renamed only when every rank has finished;
the metadata file is written last, so a folder without it is never taken for a checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_rlhf.checkpoint.model_ckpt import META_FILE, FORMAT_VERSION, dtype_name, read_sharded
from megatron_rlhf.errors import UserError
from megatron_rlhf.trainer.engine import Trainable

PREFIX = "step_"


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)
             and not p.name.endswith(".partial") and (p / META_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": np.random.get_state(), "tracker": get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    get_cuda_rng_tracker().set_states(state["tracker"])


# megatron-core 0.16.1's default distributed-optimizer format (fully_sharded_model_space) is
# refused by its own torch_dist writer ("flattened_range is not supported"); fully_reshardable
# also lets a resume change TP/PP/EP, not only DP. MoE models at EP > 1 chain a second optimizer
# for the experts: without the chain's key prefix its state is keyed by parameter, so it loads
# into EP = 1's single optimizer too.
_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable",
                     "chained_optim_avoid_prefix": True}


def _sharded_state(trainable: Trainable, loading: bool) -> dict:
    model_state = trainable.module.sharded_state_dict()
    return {"model": model_state,
            "optimizer": trainable.optimizer.sharded_state_dict(model_state, is_loading=loading,
                                                                metadata=_OPTIMIZER_FORMAT)}


def _optimizer_count(trainable: Trainable) -> int:
    return len(getattr(trainable.optimizer, "chained_optimizers", None) or [trainable.optimizer])


def save_train_checkpoint(root: str | os.PathLike, step: int, trainable: Trainable, meta: dict,
                          hf_config, tokenizer, trainer_state: dict, keep_last_n: int | None) -> Path:
    """Collective save of everything needed to resume at ``step``; prunes to ``keep_last_n``
    (``None``: the caller prunes, e.g. once every model of a multi-model run has saved)."""
    from megatron.core import dist_checkpointing

    out = Path(root) / f"{PREFIX}{step:08d}"
    partial = out.with_name(out.name + ".partial")
    rank = dist.get_rank()
    if rank == 0:
        for stale in Path(root).glob(f"{PREFIX}*.partial"):  # left by killed saves
            shutil.rmtree(stale, ignore_errors=True)
        (partial / "model").mkdir(parents=True)
        (partial / "rng").mkdir()
        hf_config.save_pretrained(partial / "hf")
        tokenizer.save_pretrained(partial / "hf")
    dist.barrier()
    dist_checkpointing.save(_sharded_state(trainable, loading=False), str(partial / "model"))
    torch.save(_rng_state(), partial / "rng" / f"rank_{rank:05d}.pt")
    dist.barrier()
    if rank == 0:
        state = {**trainer_state, "scheduler": trainable.scheduler.state_dict(),
                 "optimizers": _optimizer_count(trainable)}
        (partial / "trainer_state.json").write_text(json.dumps(state, indent=2))
        full_meta = {"format_version": FORMAT_VERSION, **meta,
                     "dtype": dtype_name(trainable.module.config.params_dtype)}
        (partial / META_FILE).write_text(json.dumps(full_meta, indent=2))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(partial, out)
        for old in complete_checkpoints(root)[:-keep_last_n] if keep_last_n else []:
            shutil.rmtree(old)
    dist.barrier()
    return out


def read_checkpoint_files(path: str | os.PathLike) -> tuple[dict, dict | None]:
    """``trainer_state.json`` and this rank's RNG state (None when saved by another world
    size), read before anything collective so that a rank failing here can be agreed on."""
    path = Path(path)
    try:
        state = json.loads((path / "trainer_state.json").read_text())
        if not isinstance(state, dict) or not {"step", "scheduler"} <= state.keys():
            raise ValueError("no 'step' and 'scheduler' entries")
        rng_file = path / "rng" / f"rank_{dist.get_rank():05d}.pt"
        rng = torch.load(rng_file, weights_only=False) if rng_file.is_file() else None
    except Exception as err:  # OSError, JSON, unpickling: all mean "damaged"
        raise UserError(f"checkpoint {path}: trainer state cannot be read "
                        f"({type(err).__name__}: {err})") from None
    return state, rng


def load_train_checkpoint(path: str | os.PathLike, trainable: Trainable,
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
    trainable.scheduler.load_state_dict(state.pop("scheduler"))
    if rng is not None:
        _set_rng_state(rng)
    return state
