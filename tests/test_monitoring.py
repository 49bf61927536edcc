"""trainer.logger: TensorBoard and wandb (offline) get the same scalar names and values."""

import os

import pytest

from megatron_rlhf.errors import UserError
from megatron_rlhf.monitoring import MetricsLogger, logger_kinds


def test_logger_kinds():
    assert logger_kinds("tensorboard") == ["tensorboard"]
    assert logger_kinds(["console", "tensorboard", "wandb"]) == ["console", "tensorboard", "wandb"]
    assert logger_kinds("tensorboard,wandb") == ["tensorboard", "wandb"]
    with pytest.raises(UserError, match="trainer.logger='mlflow' must be one of"):
        logger_kinds("mlflow")


def test_wandb_offline_gets_the_tensorboard_scalars(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline by default: no network here
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(str(tmp_path), ["console", "tensorboard", "wandb"], 3, True)
    for step in (1, 2, 3):
        logger.scalars(step, {"reward/score_mean": 0.1 * step, "actor/kl": 0.01 * step})
    summary = {key: logger.wandb.summary[key] for key in logger.wandb.summary.keys()}
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    runs = [p for p in (tmp_path / "wandb").iterdir() if p.name.startswith("offline-run-")]
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))  # written offline, to the run
    assert tags == {"reward/score_mean", "actor/kl"} and tags <= set(summary)
    assert summary["reward/score_mean"] == pytest.approx(0.3)
    assert summary["trainer/step"] == 3
    assert os.environ.get("WANDB_MODE") is None  # the logger chose offline without setting it
