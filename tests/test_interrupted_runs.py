"""Runs that survive the cluster, supervised trainers: SIGKILL of the process tree at seeded
moments (start-up, during a save, mid-training), a stop signal mid-step (a second one during
the stop's save), each followed by a relaunch of the same command, end with every logged value
(metrics.jsonl and TensorBoard) bitwise equal to a run never interrupted, no row missing or
doubled, no unfinished checkpoint left; a finished run relaunched does nothing; a deadline
(``trainer.stop_at``) stops a run in time."""

import random
import subprocess
import sys
import signal
import time

import pytest

from megatron_rlhf.errors import EXIT_STOPPED
from tests.interrupt import (finish, kill_tree, launch, leftovers, rows, saving, scalars, steady,
                             wait_until)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from tests.tiny_models import build_task_workspace

    return build_task_workspace(tmp_path_factory.mktemp("interrupted"), train=400, val=48, seed=3,
                                high=30)


def rm_args(ws, out, steps=24, *extra):
    data = ws / "data"
    return ["train-rm", "--config", "configs/rm/tiny_cpu.yaml", f"model.path={ws / 'base'}",
            f"data.train_files=[{data / 'prefs_train.parquet'}]",
            f"data.val_files=[{data / 'prefs_val.parquet'}]", f"trainer.output_dir={out}",
            "data.train_batch_size=8", "data.micro_batch_size_per_rank=4",
            "data.max_prompt_length=24", "data.max_response_length=16",
            f"trainer.max_steps={steps}", "trainer.logger=tensorboard", "trainer.log_every_steps=5",
            "trainer.eval_every_steps=8", "trainer.save_every_steps=4", "trainer.keep_last_n=2",
            "optim.lr=1e-3", *extra]


def sft_args(ws, out, *extra):
    data = ws / "data"
    return ["sft", "--config", "configs/sft/tiny_cpu.yaml", f"model.path={ws / 'base'}",
            f"data.train_files=[{data / 'sft_train.parquet'}]",
            f"data.val_files=[{data / 'sft_val.parquet'}]", f"trainer.output_dir={out}",
            "data.train_batch_size=8", "data.micro_batch_size_per_rank=4",
            "data.max_prompt_length=24", "data.max_response_length=16", "trainer.max_steps=12",
            "trainer.logger=tensorboard", "trainer.save_every_steps=3", "trainer.keep_last_n=2",
            *extra]


def _straight(args, out, log):
    proc = launch(args, log)
    assert finish(proc) == 0, log.read_text()[-3000:]
    return out


def _assert_same_run(out, reference):
    assert [r["step"] for r in rows(out)] == [r["step"] for r in rows(reference)]
    assert steady(out) == steady(reference)  # every value, bitwise
    assert scalars(out) == scalars(reference)
    assert leftovers(out) == []
    names = lambda run: sorted(p.name for p in (run / "checkpoints").iterdir())  # noqa: E731
    assert names(out) == names(reference)


def test_train_rm_survives_kills_and_a_stop_at_seeded_moments(workspace, tmp_path):
    reference = _straight(rm_args(workspace, tmp_path / "straight"), tmp_path / "straight",
                          tmp_path / "straight.log")
    out, log = tmp_path / "run", tmp_path / "run.log"
    args = rm_args(workspace, out)
    moments = random.Random(26)
    # 1. start-up: before the first step (imports, data, model build)
    proc = launch(args, log)
    time.sleep(moments.uniform(1.0, 4.0))
    kill_tree(proc)
    # 2. a save: the newest checkpoint half-written
    proc = launch(args, log)
    assert wait_until(proc, lambda: saving(out)), log.read_text()[-2000:]
    kill_tree(proc)
    # 3. a stop signal mid-step, a second one during the stop's save
    proc = launch(args, log)
    target = len(rows(out)) + moments.randint(2, 5)
    assert wait_until(proc, lambda: len(rows(out)) >= target)
    proc.send_signal(signal.SIGUSR1)
    if wait_until(proc, lambda: saving(out)):
        proc.send_signal(signal.SIGUSR1)
    assert finish(proc) == EXIT_STOPPED, log.read_text()[-2000:]
    text = log.read_text()
    assert "stopped at step" in text and "SIGUSR1 received" in text
    stopped = int(text.rsplit("stopped at step ", 1)[1].split()[0])
    assert (out / "checkpoints" / f"step_{stopped:08d}" / "megatron_rlhf.json").is_file()
    assert rows(out)[-1]["step"] == stopped  # the loggers were flushed up to the stop
    # 4. mid-training, between saves
    proc = launch(args, log)
    target = len(rows(out)) + moments.randint(2, 6)
    assert wait_until(proc, lambda: len(rows(out)) >= target)
    kill_tree(proc)
    proc = launch(args, log)
    assert finish(proc) == 0, log.read_text()[-3000:]
    _assert_same_run(out, reference)
    # A finished run relaunched (a job requeued after it ended) does nothing.
    before = sorted((p.name, p.stat().st_mtime_ns) for p in out.rglob("*"))
    again = tmp_path / "again.log"
    proc = launch(args, again)
    assert finish(proc) == 0
    assert "already finished 24 steps" in again.read_text()
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.rglob("*")) == before


def test_sft_killed_during_a_save_resumes_exactly(workspace, tmp_path):
    reference = _straight(sft_args(workspace, tmp_path / "straight"), tmp_path / "straight",
                          tmp_path / "straight.log")
    out, log = tmp_path / "run", tmp_path / "run.log"
    proc = launch(sft_args(workspace, out), log)
    # The second save: a checkpoint before it exists and must survive the kill.
    assert wait_until(proc, lambda: (out / "checkpoints" / "step_00000006.partial").is_dir())
    kill_tree(proc)
    proc = launch(sft_args(workspace, out), log)
    assert finish(proc) == 0, log.read_text()[-3000:]
    text = log.read_text()
    # The kill lands within 20 ms of seeing the save in flight: the unfinished folder is removed
    # and the run resumes from the save before it, or (rarely) the save committed in between.
    resumed = 3 if "removed 1 unfinished checkpoint folder(s)" in text else 6
    assert f"resumed from {out / 'checkpoints' / f'step_{resumed:08d}'}" in text, text[-3000:]
    _assert_same_run(out, reference)


def test_a_deadline_stops_the_run_in_time_and_it_resumes(workspace, tmp_path):
    """``trainer.stop_at`` as a duration from the job's start: the run stops at a step
    boundary with a checkpoint before the deadline (it would need far longer to finish), and
    the relaunch, without a deadline, continues from it."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    # Minutes of steps. The deadline leaves five minutes for start-up on a loaded machine (a
    # CI run took over a minute; the run stops at its first boundary then), the margin makes a
    # fast one stop ~15 s after launch.
    long = ("trainer.total_epochs=100", "trainer.stop_margin_s=285")
    proc = launch(rm_args(workspace, out, 2000, "trainer.stop_at=300s", *long), log)
    assert finish(proc) == EXIT_STOPPED, log.read_text()[-2000:]
    text = log.read_text()
    left = float(text.split("trainer.stop_at in ", 1)[1].split()[0])
    assert left > 0  # stopped with time to spare for the save, by the run's own clock
    stopped = int(text.rsplit("stopped at step ", 1)[1].split()[0])
    assert 0 < stopped < 2000
    assert (out / "checkpoints" / f"step_{stopped:08d}" / "megatron_rlhf.json").is_file()
    proc = launch(rm_args(workspace, out, stopped + 2, "trainer.stop_at=none", *long), log)
    assert finish(proc) == 0, log.read_text()[-2000:]
    assert f"resumed from {out / 'checkpoints' / f'step_{stopped:08d}'}" in log.read_text()
    assert [r["step"] for r in rows(out)] == list(range(1, stopped + 3))


def test_a_stop_signal_reaching_one_rank_stops_every_rank_together(workspace, tmp_path):
    """Two ranks (DP=2, the local launcher): SIGUSR1 to rank 1 alone; the ranks agree at one
    boundary (a collective flag), save, and exit 75 together; the relaunch continues exactly."""
    import psutil

    reference = _straight(rm_args(workspace, tmp_path / "straight", 16, "--nproc-per-node", "2"),
                          tmp_path / "straight", tmp_path / "straight.log")
    out, log = tmp_path / "run", tmp_path / "run.log"
    args = rm_args(workspace, out, 16, "--nproc-per-node", "2")
    proc = launch(args, log)
    assert wait_until(proc, lambda: len(rows(out)) >= 5)
    ranks = [p for p in psutil.Process(proc.pid).children()
             if "megatron_rlhf.cli" in " ".join(p.cmdline())]
    assert len(ranks) == 2
    one = next(p for p in ranks if p.environ().get("RANK") == "1")
    one.send_signal(signal.SIGUSR1)
    assert finish(proc) == EXIT_STOPPED, log.read_text()[-2000:]
    assert "a stop signal on another rank" in log.read_text()  # rank 0 stopped for rank 1
    proc = launch(args, log)
    assert finish(proc) == 0, log.read_text()[-2000:]
    _assert_same_run(out, reference)


def test_a_kill_during_an_asynchronous_save_leaves_the_previous_checkpoint_in_charge(workspace, tmp_path):
    """``trainer.async_save``: training goes on while the shards are written, the checkpoint is
    committed only once written; SIGKILL while it is half-written (steps already trained past
    it) resumes from the one before, and the run ends equal to a synchronous, uninterrupted one."""
    reference = _straight(rm_args(workspace, tmp_path / "straight"), tmp_path / "straight",
                          tmp_path / "straight.log")
    out, log = tmp_path / "run", tmp_path / "run.log"
    args = rm_args(workspace, out, 24, "trainer.async_save=true", "trainer.log_every_steps=1")
    ckpt = lambda step: out / "checkpoints" / f"step_{step:08d}"  # noqa: E731
    proc = launch(args, log)
    assert wait_until(proc, lambda: (ckpt(4) / "megatron_rlhf.json").is_file())
    kill_tree(proc)
    proc = launch(args, log)  # resumes at 4; its first save (step 8) is its slowest
    # One step trained past the save in flight (row 9): a save can commit within 0.2 s, and
    # waiting for a second step once left no moment to kill it in.
    assert wait_until(proc, lambda: ckpt(8).with_name(ckpt(8).name + ".partial").is_dir()
                      and len(rows(out)) >= 9), log.read_text()[-2000:]
    kill_tree(proc)
    assert (ckpt(4) / "megatron_rlhf.json").is_file() and not ckpt(8).exists()
    proc = launch(args, log)
    assert finish(proc) == 0, log.read_text()[-3000:]
    assert "resumed from" in log.read_text() and "committed" in log.read_text()
    _assert_same_run(out, reference)


def test_the_checkpoint_writer_queue_dies_with_its_process():
    """megatron's checkpoint-writer results queue runs in a server process of its own
    (checkpoint/model_ckpt.py:start_writer_queue); a trainer SIGKILLed takes it along instead
    of leaving it behind (megatron's own, started by spawn, outlived killed runs), also when the
    trainer handles SIGTERM itself, as ours do (the fork inherits the handlers: CI4 left the
    servers of a killed EP=2 run's ranks behind). Stop signals sent to every process (Slurm's
    to a step, Ctrl-C's to a process group) leave the server serving: the trainer's closing
    save needs it (CI's two-node USR1 run lost a server forked as the signal went round)."""
    import psutil

    code = ("import signal, sys\nsignal.signal(signal.SIGTERM, lambda *_: None)\n"
            "signal.signal(signal.SIGUSR1, lambda *_: None)\n"
            "from megatron_rlhf.checkpoint.model_ckpt import start_writer_queue\n"
            "start_writer_queue()\n"
            "from megatron.core.dist_checkpointing.strategies import filesystem_async as f\n"
            "f._results_queue.put(7)\nassert f._results_queue.get() == 7\n"
            "print('ready', flush=True)\nsys.stdin.readline()\n"
            "f._results_queue.put(8)\nprint('served', f._results_queue.get(), flush=True)\n"
            "import time\ntime.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        servers = psutil.Process(proc.pid).children()
        assert len(servers) == 1
        for sig in (signal.SIGUSR1, signal.SIGINT, signal.SIGTERM, signal.SIGUSR2):
            servers[0].send_signal(sig)
        time.sleep(0.5)
        assert servers[0].is_running() and servers[0].status() != psutil.STATUS_ZOMBIE
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "served 8"
    finally:
        proc.kill()
        proc.wait()
    gone, alive = psutil.wait_procs(servers, timeout=30)
    assert not alive, f"the queue's server outlived its killed process: {alive}"


def test_a_writer_queue_killed_from_outside_is_started_again_at_the_next_save():
    """CI13: a pytest worker's in-process saves failed with EOFError at megatron's results
    queue once its server had died; the next save's ``start_writer_queue`` now starts another."""
    code = ("import os, signal, time\n"
            "from megatron_rlhf.checkpoint.model_ckpt import start_writer_queue\n"
            "from megatron.core.dist_checkpointing.strategies import filesystem_async as f\n"
            "import megatron_rlhf.checkpoint.model_ckpt as m\n"
            "start_writer_queue(); first = f._results_queue\n"
            "os.kill(m._MANAGER[1]._process.pid, signal.SIGKILL); time.sleep(0.5)\n"
            "start_writer_queue(); assert f._results_queue is not first\n"
            "f._results_queue.put(9); print('served', f._results_queue.get(), flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "served 9" in proc.stdout, proc.stderr[-2000:]
