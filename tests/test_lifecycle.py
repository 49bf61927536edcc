"""Stop requests, deadlines, the finished marker and the metrics file, by hand."""

import json
import os
import signal
from types import SimpleNamespace

import pytest

from megatron_rlhf.config.stopping import JOB_START_ENV, stop_deadline, stop_signals
from megatron_rlhf.errors import UserError
from megatron_rlhf.trainers.lifecycle import (MetricsFile, StopRequest, catch_early, finished,
                                             mark_finished, release_early, run_fingerprint)


def trainer(**kw):
    base = dict(stop_signals=["SIGUSR1", "SIGTERM"], stop_at="none", stop_margin_s=60.0)
    return SimpleNamespace(**{**base, **kw})


def test_deadlines_from_every_form():
    env = {"SLURM_JOB_START_TIME": "1000", "SLURM_JOB_END_TIME": "5000"}
    assert stop_deadline("auto", env) == 5000.0
    assert stop_deadline("auto", {}) is None
    assert stop_deadline("none", env) is None
    assert stop_deadline("90m", env) == 1000 + 5400
    assert stop_deadline("1h30m", env) == 1000 + 5400
    assert stop_deadline("3600s", env) == 4600
    assert stop_deadline("4h", {JOB_START_ENV: "10"}) == 10 + 4 * 3600  # no Slurm: the launch
    assert stop_deadline("1796216000", env) == 1796216000.0
    assert stop_deadline("2026-12-03T06:00:00+00:00", env) == 1796277600.0
    for bad in ("tomorrow", "5 minutes", "-3h"):
        with pytest.raises(UserError, match="trainer.stop_at"):
            stop_deadline(bad, env)


def test_stop_signal_names():
    assert stop_signals(["SIGUSR1", "term", "USR2"]) == [signal.SIGUSR1, signal.SIGTERM,
                                                         signal.SIGUSR2]
    assert stop_signals([]) == []
    for bad in ("SIGKILL", "SIGINT", "NOPE"):
        with pytest.raises(UserError, match="trainer.stop_signals"):
            stop_signals([bad])


def test_the_deadline_leaves_room_for_a_step_and_two_saves():
    stop = StopRequest(trainer(stop_margin_s=10), None)
    stop.deadline = 1000.0
    stop.observe(step_s=5, save_s=20)
    stop.observe(step_s=3, save_s=1)  # the longest seen counts
    assert stop.reason(now=1000 - 56) is None  # 56 s left > 5 + 2 x 20 + 10
    assert "trainer.stop_at in 55 s" in stop.reason(now=1000 - 55)


def test_a_caught_signal_is_a_reason_and_a_second_changes_nothing():
    before = signal.getsignal(signal.SIGUSR2)
    stop = StopRequest(trainer(stop_signals=["SIGUSR2"]), None).install()
    try:
        assert stop.reason() is None
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.reason() == "SIGUSR2 received"
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGUSR2) == before  # put back as it was


def test_a_signal_during_start_up_is_kept_for_the_run():
    """Slurm's time-limit USR1 can arrive while the job still imports: it must become the run's
    stop reason (Python's default action would kill the job, which Slurm reads as a failure)."""
    before = signal.getsignal(signal.SIGUSR1)
    early = catch_early()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # before any StopRequest exists: not fatal
        stop = StopRequest(trainer(), "test")
        assert stop.reason() == "SIGUSR1 received"
        assert StopRequest(trainer(stop_signals=["SIGTERM"]), None).reason() is None
    finally:
        release_early(early)
    assert signal.getsignal(signal.SIGUSR1) == before
    assert StopRequest(trainer(), None).reason() is None  # released: the next run starts clean


def test_finished_marker_matches_its_settings_and_what_the_run_left(tmp_path):
    cfg = SimpleNamespace(trainer=SimpleNamespace(max_steps=10, total_epochs=1, output_dir=str(tmp_path)),
                          data=SimpleNamespace(train_batch_size=8, train_files=["a.parquet"]))
    final = tmp_path / "checkpoints" / "step_00000010"
    (final / "model").mkdir(parents=True)
    (final / "model" / "shard").write_bytes(b"12345678")
    (tmp_path / "metrics.jsonl").write_text('{"step": 10}\n')
    assert finished(tmp_path, cfg) is None
    mark_finished(tmp_path, cfg, 10, [final, tmp_path / "metrics.jsonl"])
    assert finished(tmp_path, cfg) == 10
    saved = json.loads((tmp_path / "finished.json").read_text())
    assert saved["fingerprint"] == run_fingerprint(cfg)
    assert saved["files"] == {"checkpoints/step_00000010/model/shard": 8, "metrics.jsonl": 13}
    (final / "model" / "shard").write_bytes(b"1234")  # damaged since: resume instead
    assert finished(tmp_path, cfg) is None and not (tmp_path / "finished.json").exists()
    (final / "model" / "shard").write_bytes(b"12345678")
    mark_finished(tmp_path, cfg, 10, [final, tmp_path / "metrics.jsonl"])
    cfg.trainer.max_steps = 20  # more steps asked for: not finished, and the marker goes
    assert finished(tmp_path, cfg) is None and not (tmp_path / "finished.json").exists()


def test_metrics_file_keeps_what_a_checkpoint_had_seen(tmp_path):
    metrics = MetricsFile(tmp_path / "metrics.jsonl")
    for row in ({"step": 0, "val/x": 1}, {"step": 1, "a": 1}, {"step": 2, "a": 2},
                {"step": 2, "val/x": 2}, {"step": 3, "a": 3}):
        metrics.append(row)
    with metrics.path.open("a") as handle:
        handle.write('{"step": 4, "a"')  # a line half-written by a killed run
    assert metrics.rows() == 5
    assert [r["step"] for r in metrics.trim(2, rows=3)] == [0, 1, 2]  # the final validation goes
    assert metrics.rows() == 3
    metrics.append({"step": 3, "a": 3})
    assert [r["step"] for r in metrics.trim(1)] == [0, 1]  # a checkpoint without a count: by step
    assert metrics.trim(0, rows=0) == [] and metrics.path.read_text() == ""
