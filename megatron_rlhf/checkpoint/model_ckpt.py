"""Model checkpoints: a Megatron distributed checkpoint (torch_dist) plus what rebuilds the model.

Layout of a checkpoint folder::

    CKPT/megatron_rlhf.json   format, model kind, padded vocab, dtype (written last: marks completion)
    CKPT/hf/                  HF config and tokenizer files (no weights)
    CKPT/model/               megatron.core.dist_checkpointing torch_dist shards

Saves go to ``CKPT.partial`` and are renamed into place only when complete, so a killed save never
leaves a folder that looks finished. Loads reshard to any TP/PP layout.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rlhf.checkpoint.safe_load import RefusedCheckpointFile, check_torch_dist
from megatron_rlhf.checkpoint.hf_io import copy_hf_assets
from megatron_rlhf.distributed.layout import ParallelGroups
from megatron_rlhf.errors import UserError
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.hf_config import ModelArch, arch_from_hf_config
from megatron_rlhf.models.lora import LoRASpec, apply_lora, merge_adapters

META_FILE = "megatron_rlhf.json"
FORMAT_VERSION = 1
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint folder says about the model inside it."""

    path: Path
    arch: ModelArch
    padded_vocab: int
    dtype: torch.dtype
    lora: LoRASpec | None = None  # the adapters saved beside the base weights (LoRA training)

    @property
    def hf_dir(self) -> Path:
        return self.path / "hf"


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in _DTYPES.items()}[dtype]


def read_checkpoint_info(ckpt_dir: str | os.PathLike) -> CheckpointInfo:
    """Read a checkpoint's metadata; :class:`UserError` if the folder is not a complete one."""
    from transformers import AutoConfig

    path = Path(ckpt_dir)
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise UserError(f"{path} is not a complete megatron_rlhf checkpoint (no {META_FILE})")
    meta = json.loads(meta_path.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{meta_path}: unsupported format_version {meta.get('format_version')}")
    arch = arch_from_hf_config(AutoConfig.from_pretrained(path / "hf", local_files_only=True))
    lora = LoRASpec.from_dict(meta["lora"]) if meta.get("lora") else None
    return CheckpointInfo(path, arch, int(meta["padded_vocab"]), _DTYPES[meta["dtype"]], lora)


def check_writable(out_dir: str | os.PathLike) -> Path:
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"output folder {out} already exists and is not empty")
    return out


def start_writer_queue() -> None:
    """Start megatron's checkpoint-writer results queue by fork, once per process.

    ``dist_checkpointing`` saves hand their write results back through a ``Manager().Queue()``
    that megatron-core 0.16.1 starts with the *spawn* method at a process's first save: a fresh
    interpreter that re-imports the parent's ``__main__`` (torch, megatron), 5-10 s of every
    process's first checkpoint on 2 cores (0.02 s by fork; docs/testing.md). Megatron forks its
    writer processes from the same process anyway, so the manager's server is forked too.
    Call before a save; later calls do nothing.
    """
    import functools
    import multiprocessing
    import threading

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    global _MANAGER
    ours = _MANAGER is not None and _MANAGER[0] == os.getpid()
    if ours and filesystem_async._results_queue is _MANAGER[2] and not _MANAGER[1]._process.is_alive():
        # The server is gone (killed from outside): a save through it would fail with EOFError
        # (seen in CI, a long-lived process saving again much later), so start another one.
        filesystem_async._results_queue = None
    if filesystem_async._results_queue is None:
        from multiprocessing.managers import SyncManager

        manager = SyncManager(ctx=multiprocessing.get_context("fork"))
        # The death signal follows the thread that forks: only the main thread lives as long as
        # the process (saves run there today; from another thread the server just stays).
        main = threading.current_thread() is threading.main_thread()
        manager.start(functools.partial(_die_with_parent, os.getpid()) if main else None)
        filesystem_async._results_queue = manager.Queue()
        _MANAGER = (os.getpid(), manager, filesystem_async._results_queue)


_MANAGER = None  # (pid, manager, queue) of the queue this process started


def _die_with_parent(parent: int) -> None:
    """In the queue's server process: end when the process that started it ends, even by
    SIGKILL (megatron's spawn-started one outlived a killed trainer), and never before. Stop
    signals are for the trainer: Slurm signals every process of a step and Ctrl-C the whole
    process group, so a server that kept the trainer's handlers (caught, survived with no loop
    to stop) or took the defaults (died in the trainer's closing save: CI's two-node USR1 test)
    is wrong either way; it ignores them and the death signal, SIGKILL, ends it with its parent."""
    import ctypes
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the server stays until its parent's exit
        return
    if os.getppid() != parent:  # the trainer died before the request was made
        os._exit(0)


def save_model_checkpoint(model, out_dir: str | os.PathLike, arch: ModelArch, padded_vocab: int,
                          dtype: torch.dtype, hf_assets_dir: str | os.PathLike,
                          sharded_strategy=None, verify=None,
                          lora: LoRASpec | None = None) -> Path:
    """Collectively save ``model`` (all ranks call this) atomically into ``out_dir``; ``lora``:
    the spec of the adapters ``model`` carries (recorded, so loads rebuild them);
    ``sharded_strategy``: a ``dist_checkpointing`` save strategy (default: megatron's);
    ``verify(partial_folder)``: run by every rank once the shards are written, before the
    folder is marked complete (its error leaves ``OUT.partial`` as it is)."""
    from megatron.core import dist_checkpointing

    out = Path(out_dir)
    partial = out.with_name(out.name + ".partial")
    rank = dist.get_rank()
    if rank == 0:
        check_writable(out)
        shutil.rmtree(partial, ignore_errors=True)
        (partial / "model").mkdir(parents=True)
        copy_hf_assets(hf_assets_dir, partial / "hf")
    dist.barrier()
    start_writer_queue()
    dist_checkpointing.save(model.sharded_state_dict(), str(partial / "model"),
                            sharded_strategy=sharded_strategy)
    dist.barrier()
    if verify is not None:
        verify(partial)
    if rank == 0:
        meta = {"format_version": FORMAT_VERSION, "kind": arch.kind, "family": arch.family,
                "padded_vocab": padded_vocab, "dtype": dtype_name(dtype)}
        if lora is not None and lora.rank:
            meta["lora"] = lora.as_dict()
        (partial / META_FILE).write_text(json.dumps(meta, indent=2))
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(partial, out)
    dist.barrier()
    return out


def read_sharded(wanted: dict, path: Path, whole: bool = True) -> dict:
    """``dist_checkpointing.load`` of ``path/model``, its pickled files checked first
    (:func:`~megatron_rlhf.checkpoint.safe_load.check_torch_dist`); an unreadable (truncated,
    half-copied) checkpoint is a :class:`UserError` naming it, not a traceback. ``whole=False`` reads a
    subset (megatron's access-integrity check wants every tensor read in full by the ranks)."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        check_torch_dist(path / "model")  # before megatron-core unpickles any of it
    except RefusedCheckpointFile:
        raise
    except UserError as err:
        raise UserError(f"checkpoint {path} cannot be read ({err}); it may be incomplete or "
                        "damaged") from None
    try:
        return dist_checkpointing.load(wanted, str(path / "model"), validate_access_integrity=whole)
    except (Exception, CheckpointException) as err:  # the latter is a BaseException
        # A CheckpointException carries each failed rank's own exception: show the first.
        failures = getattr(err, "failures", None)
        cause = next(iter(failures.values())) if failures else err
        cause = getattr(cause, "exc", cause)  # torch wraps it with its traceback
        text = " ".join(str(cause).split())[:300]
        raise UserError(f"checkpoint {path} cannot be read ({type(cause).__name__}: {text}); it "
                        "may be incomplete or damaged") from None


def load_model_checkpoint(info: CheckpointInfo, groups: ParallelGroups,
                          dtype: torch.dtype | None = None, options=None,
                          keep_adapters: bool = False):
    """Build this rank's model stage under ``groups`` and fill it from the checkpoint, in
    ``dtype`` (a trainer's configured one) or else the dtype it was saved in; ``options``: the
    trainer's :class:`~megatron_rlhf.models.megatron_config.ModelOptions`. A checkpoint with LoRA
    adapters comes back with them merged into its weights (a plain model), or kept as adapters
    on the frozen base with ``keep_adapters``."""
    model = build_model(info.arch, groups, dtype or info.dtype, info.padded_vocab, options)
    if info.lora is not None:
        apply_lora(model, info.lora)
    wanted = model.sharded_state_dict()
    state = read_sharded(wanted, info.path)
    # Training checkpoints also hold optimizer state; only the model's entries are wanted here.
    model.load_state_dict({key: state[key] for key in wanted})
    if info.lora is not None and not keep_adapters:
        merge_adapters(model)
    return model
