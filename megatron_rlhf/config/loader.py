"""Load, merge (defaults <- YAML <- ``key=value``), validate: the only place batch arithmetic happens."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_rlhf.config.parallel import check_parallel
from megatron_rlhf.config.schema import RMConfig, SFTConfig
from megatron_rlhf.config.stopping import check_stop_settings
from megatron_rlhf.errors import UserError
from megatron_rlhf.monitoring import logger_kinds

T = TypeVar("T")


def load_config(schema: type[T], yaml_path: str | None, overrides: list[str]) -> T:
    """Merge ``yaml_path`` and ``overrides`` onto ``schema``'s defaults; errors name the key."""
    try:
        merged = OmegaConf.structured(schema)
        if yaml_path is not None:
            merged = OmegaConf.merge(merged, _as_lists(merged, _read_yaml(yaml_path)))
        bad = [item for item in overrides if "=" not in item]
        if bad:
            raise UserError(f"override {bad[0]!r} is not of the form key=value")
        # ``agents.1.optim.lr=...`` addresses a list item: OmegaConf's dotlist would make the
        # list a dict; those go in place, the rest merge (so a single value becomes a list).
        indexed = [item for item in overrides if _indexes_list(item.split("=", 1)[0])]
        plain = [item for item in overrides if item not in indexed]
        merged = OmegaConf.merge(merged, _as_lists(merged, OmegaConf.from_dotlist(plain)))
        for item in indexed:
            key, value = item.split("=", 1)
            parts = key.split(".")
            last = max(i for i, part in enumerate(parts) if part.isdigit())
            if OmegaConf.select(merged, ".".join(parts[:last + 1])) is None:
                raise UserError(f"config: {key}: no such list item (override {item!r})")
            parsed = OmegaConf.from_dotlist([f"value={value}"])
            OmegaConf.update(merged, key, parsed.value, merge=True)
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise UserError(f"config: missing required value for {missing[0]}")
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        where = f"{key}: " if key else ""
        raise UserError(f"config: {where}{str(err).splitlines()[0]}") from None
    _check_finite(config, "")
    return config


def _indexes_list(key: str) -> bool:
    return any(part.isdigit() for part in key.split("."))


def _as_lists(schema: DictConfig, given: DictConfig) -> DictConfig:
    """A single value where the schema has a list (``data.train_files=a.parquet``) is a list of
    one, as verl reads it, instead of OmegaConf's type error."""
    for key in list(given.keys()):
        node, value = schema.get(key), given._get_node(key)
        if OmegaConf.is_list(node) and isinstance(value._value(), (str, int, float)):
            given[key] = [given[key]]
        elif OmegaConf.is_dict(node) and OmegaConf.is_dict(value):
            _as_lists(node, value)
    return given


def _check_finite(section, prefix: str) -> None:
    """No NaN or infinity anywhere in the tree: no key means "off" by either."""
    for item in fields(section):
        value, name = getattr(section, item.name), f"{prefix}{item.name}"
        if is_dataclass(value):
            _check_finite(value, f"{name}.")
            continue
        numbered = enumerate(value) if isinstance(value, list) else [(None, value)]
        for index, number in numbered:
            if isinstance(number, float) and not math.isfinite(number):
                where = name if index is None else f"{name}[{index}]"
                raise UserError(f"config: {where}={number} must be a finite number")


def _read_yaml(path: str):
    import yaml

    if not Path(path).is_file():
        raise UserError(f"config file not found: {path}")
    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as err:
        raise UserError(f"config file {path}: not valid YAML ({' '.join(str(err).split())})") from None
    if not isinstance(loaded, DictConfig):
        raise UserError(f"config file {path}: the top level must be a mapping of sections, "
                        f"not a {type(loaded).__name__}")
    return loaded


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's examples (pairs for reward models, samples for SFT) are split
    over ranks and micro-batches."""

    per_step: int  # examples per optimizer step, global
    per_rank_step: int  # examples per optimizer step, per data-parallel rank
    per_micro_batch: int  # examples per forward/backward, per rank
    micro_batches_per_step: int  # per rank (gradient accumulation)


def batch_plan(train_batch_size: int, micro_batch_size_per_rank: int, dp: int) -> BatchPlan:
    if train_batch_size % dp:
        raise UserError(f"config: data.train_batch_size={train_batch_size} is not divisible "
                        f"by the data-parallel size {dp}")
    per_rank = train_batch_size // dp
    if per_rank % micro_batch_size_per_rank:
        raise UserError(f"config: data.train_batch_size / dp = {per_rank} per rank is not "
                        f"divisible by data.micro_batch_size_per_rank={micro_batch_size_per_rank}")
    return BatchPlan(train_batch_size, per_rank, micro_batch_size_per_rank,
                     per_rank // micro_batch_size_per_rank)


def check_positive(name: str, value) -> None:
    """``value`` at config key ``name`` is a finite number > 0 (None and NaN are not)."""
    if value is None or not value > 0 or not math.isfinite(value):  # NaN compares false
        raise UserError(f"config: {name}={value} must be positive")


def check_optim(prefix: str, optim) -> None:
    """An ``OptimConfig`` at ``prefix`` (``optim``, ``actor.optim``, ...): finite, in range."""
    check_positive(f"{prefix}.lr", optim.lr)
    check_positive(f"{prefix}.eps", optim.eps)
    for name in ("min_lr", "weight_decay", "clip_grad"):
        value = getattr(optim, name)
        if not (value >= 0 and math.isfinite(value)):
            raise UserError(f"config: {prefix}.{name}={value} must be >= 0")
    if optim.min_lr > optim.lr:
        raise UserError(f"config: {prefix}.min_lr={optim.min_lr} exceeds {prefix}.lr={optim.lr}")
    if not 0 <= optim.warmup_steps_ratio < 1:
        raise UserError(f"config: {prefix}.warmup_steps_ratio={optim.warmup_steps_ratio} must be "
                        "in [0, 1)")
    if len(optim.betas) != 2 or not all(0 <= b < 1 for b in optim.betas):
        raise UserError(f"config: {prefix}.betas={list(optim.betas)} must be two values in [0, 1)")


def validate_rm_config(config: RMConfig) -> RMConfig:
    """Checks that need no process group; the DP-dependent ones live in :func:`batch_plan`."""
    return validate_training_config(config)


def validate_sft_config(config: SFTConfig) -> SFTConfig:
    return validate_training_config(config)


def validate_training_config(config):
    """The checks every trainer's config (model, data, optim, trainer sections) needs."""
    data, optim, trainer = config.data, config.optim, config.trainer
    if not data.train_files:
        raise UserError("config: data.train_files is empty")
    for name in ("max_prompt_length", "max_response_length", "train_batch_size",
                 "micro_batch_size_per_rank"):
        check_positive(f"data.{name}", getattr(data, name))
    check_optim("optim", optim)
    check_positive("trainer.total_epochs", trainer.total_epochs)
    check_positive("trainer.keep_last_n", trainer.keep_last_n)
    check_positive("trainer.log_every_steps", trainer.log_every_steps)
    for name in ("save_every_steps", "eval_every_steps", "max_steps"):
        if getattr(trainer, name) < 0:
            raise UserError(f"config: trainer.{name}={getattr(trainer, name)} must be >= 0 (0: off)")
    logger_kinds(trainer.logger)  # one of, or a list of, console/tensorboard/wandb
    check_stop_settings(trainer)
    choices = {"data.overlong": (data.overlong, ("truncate", "drop")),
               "trainer.resume": (trainer.resume, ("auto", "disable")),
               "model.dtype": (config.model.dtype, ("auto", "float32", "bfloat16"))}
    for name, (value, allowed) in choices.items():
        if value not in allowed:
            raise UserError(f"config: {name}={value!r} must be one of {', '.join(allowed)}")
    check_parallel("parallel", config.parallel, config.model.moe)
    from megatron_rlhf.config.lora import lora_spec

    lora_spec("model.lora", config.model.lora)
    return config
