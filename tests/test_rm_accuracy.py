"""Acceptance: configs/rm/tiny_cpu.yaml, exactly as the README runs it, reaches >= 93% validation
accuracy on the bundled task on CPU (the spread over seeds and thread counts in
docs/benchmarks.md: worst 0.946, best 0.996); its scalars land in TensorBoard. Its wall time is a
benchmark (docs/benchmarks.md), not an assertion: a slow machine is not a wrong one."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


# One thread: the suite runs two test files at a time on 2 cores, and two 2-thread trainings
# beside each other spin on each other's cores (both took over 15 minutes that way, 6 alone). One
# thread is one of the spread's measured settings, above the bar.
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@pytest.mark.timeout(1500)
def test_tiny_cpu_reward_model_reaches_93_percent(tmp_path):
    data, base, out = tmp_path / "data", tmp_path / "base", tmp_path / "rm"
    subprocess.run([sys.executable, "tools/make_task_data.py", "--out-dir", str(data)], cwd=ROOT,
                   check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "megatron_rlhf.cli", "make-tiny-model", "--data-dir",
                    str(data), "--out-dir", str(base)], cwd=ROOT, check=True, capture_output=True)
    start = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rlhf.cli", "train-rm", "--config",
         "configs/rm/tiny_cpu.yaml", f"model.path={base}",
         f"data.train_files=[{data / 'prefs_train.parquet'}]",
         f"data.val_files=[{data / 'prefs_val.parquet'}]", f"trainer.output_dir={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=1500, env=ONE_THREAD)
    elapsed = time.time() - start
    assert proc.returncode == 0, proc.stderr[-4000:]
    final = json.loads((out / "final_metrics.json").read_text())
    print(f"tiny_cpu reward model: validation accuracy {final['val/accuracy']:.4f} "
          f"in {elapsed:.0f}s (train-rm wall time)")
    # Below the worst of the measured spread (seed 0, one thread: 0.946); this config's own seed
    # gave 0.992-1.000 here, but another CPU's rounding is another trajectory.
    assert final["val/accuracy"] >= 0.93

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/accuracy", "val/accuracy", "val/margin_mean",
            "val/chosen_reward_mean", "val/rejected_reward_std", "train/lr",
            "throughput/pairs_per_s", "throughput/tokens_per_s"} <= tags
    assert "pairs/s" in proc.stdout and "ETA" in proc.stdout
