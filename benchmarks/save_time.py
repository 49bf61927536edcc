"""How long a checkpoint save holds training up, synchronous vs ``trainer.async_save``.

    python benchmarks/save_time.py --work /tmp/save_bench [--hidden 512 --layers 8 --steps 12]

Builds a random reward-model base of the given size on the bundled task, trains it with
``train-rm`` saving every 2 steps, once with each save mode, and reports from the logs the
seconds each save blocked the trainer and the run's wall time. Figures go to
``docs/benchmarks.md`` as measured.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, log: Path) -> float:
    started = time.perf_counter()
    with log.open("w") as handle:
        subprocess.run([sys.executable, "-m", "megatron_rlhf.cli", *args], cwd=ROOT, check=True,
                       stdout=handle, stderr=subprocess.STDOUT)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    from megatron_rlhf.data.task_files import write_task_files

    if not (work / "data").is_dir():
        write_task_files(str(work / "data"), train=400, val=16, seed=0, high=30)
    base = work / f"base_{args.hidden}x{args.layers}"
    if not base.is_dir():
        _cli("make-tiny-model", "--data-dir", str(work / "data"), "--out-dir", str(base),
             "--hidden-size", str(args.hidden), "--num-layers", str(args.layers),
             log=work / "make.log")
    for mode in ("false", "true"):
        out = work / f"run_async_{mode}"
        subprocess.run(["rm", "-rf", str(out)], check=True)
        log = work / f"async_{mode}.log"
        wall = _cli("train-rm", "--config", "configs/rm/tiny_cpu.yaml", f"model.path={base}",
                    f"data.train_files=[{work / 'data' / 'prefs_train.parquet'}]",
                    "data.val_files=[]", f"trainer.output_dir={out}", "data.train_batch_size=8",
                    "data.micro_batch_size_per_rank=8", f"trainer.max_steps={args.steps}",
                    "trainer.save_every_steps=2", "trainer.keep_last_n=2",
                    "trainer.logger=console", f"trainer.async_save={mode}", log=log)
        held = [float(s) for s in re.findall(r"checkpoint step_\d+ (?:saved|handed to the "
                                             r"writer) in ([\d.]+) s", log.read_text())]
        size = sum(p.stat().st_size for p in (out / "checkpoints").rglob("*") if p.is_file())
        size /= len(list((out / "checkpoints").iterdir()))
        print(f"async_save={mode}: {len(held)} saves of {size / 2**20:.0f} MiB, held training "
              f"{statistics.median(held):.2f} s median (first {held[0]:.2f} s, max "
              f"{max(held):.2f} s); run {wall:.1f} s")


if __name__ == "__main__":
    main()
