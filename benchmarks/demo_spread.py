"""The demo's result under perturbations that stand in for other machines.

Another CPU rounds differently (other BLAS/oneDNN kernels, another summation order) and sends
training down another trajectory, from SFT on. This runs the whole demo (SFT -> reward model ->
PPO) for every seed x ``OMP_NUM_THREADS`` pair (a different thread count changes the reduction
order the way another CPU does) and prints one row per run and the spread of the PPO gain:

    python benchmarks/demo_spread.py --work /tmp/spread [--seeds 0 1 2] [--threads 1 2] [--jobs 1]

``--ppo-only NAME key=value ...`` reruns just the PPO stage of every finished run under --work
with those overrides (into ``<run>/NAME``), to try a PPO change against the same SFT policies and
reward models. ``--jobs 2`` runs two single-thread runs at once (results are unchanged, wall
times are not comparable then).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(work: Path, seed: int, threads: int, ppo_only: list[str] | None) -> dict:
    run = work / f"seed{seed}_omp{threads}"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    start = time.time()
    if ppo_only is None:
        cmd = [sys.executable, "-m", "megatron_rlhf.cli", "demo", "--out-dir", str(run), "--seed", str(seed)]
    else:
        name, overrides = ppo_only[0], ppo_only[1:]
        code = ("import sys; from pathlib import Path; from megatron_rlhf.demo import ppo_stage; "
                "root = Path(sys.argv[1]); ppo_stage(root, int(sys.argv[2]), tuple(sys.argv[4:]), "
                "out=root / sys.argv[3])")
        cmd = [sys.executable, "-c", code, str(run), str(seed), name, *overrides]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr)
        return {"seed": seed, "threads": threads, "failed": proc.returncode}
    sys.path.insert(0, str(ROOT))
    from megatron_rlhf.demo import summarize

    summary = summarize(run, run / (ppo_only[0] if ppo_only else "ppo"))
    curves = summary.pop("curves")
    summary.update(seed=seed, threads=threads, seconds=time.time() - start,
                   gain=summary["ppo_oracle_acc"] - summary["sft_oracle_acc"],
                   val_curve=[round(v, 3) for _, v in curves["val/oracle_acc"]])
    print(json.dumps(summary), flush=True)
    return summary


def report(rows: list[dict]) -> str:
    ok = [r for r in rows if "failed" not in r]
    lines = ["| seed | OMP threads | SFT acc | PPO acc | change (points) | RM pairwise acc | wall s | "
             "held-out acc at each validation |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['seed']} | {r['threads']} | failed (exit {r['failed']}) | | | | | |")
            continue
        lines.append(f"| {r['seed']} | {r['threads']} | {r['sft_oracle_acc']:.3f} | {r['ppo_oracle_acc']:.3f} "
                     f"| {100 * r['gain']:+.1f} | {r['rm_val_accuracy']:.3f} | {r['seconds']:.0f} | "
                     f"{' '.join(f'{v:.3f}' for v in r['val_curve'])} |")
    if ok:
        gains = [100 * r["gain"] for r in ok]
        lines.append(f"\nchange over {len(ok)} runs: min {min(gains):+.1f}, median "
                     f"{statistics.median(gains):+.1f}, max {max(gains):+.1f} points; "
                     f"wall s: max {max(r['seconds'] for r in ok):.0f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, help="folder for the runs (one subfolder each)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--jobs", type=int, default=1, help="runs at once")
    parser.add_argument("--ppo-only", nargs="+", metavar="NAME [key=value ...]",
                        help="rerun only the PPO stage of the runs under --work, into <run>/NAME")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    grid = [(s, t) for s in args.seeds for t in args.threads]
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda st: _run(work, st[0], st[1], args.ppo_only), grid))
    table = report(rows)
    print(table)
    (work / f"spread_{args.ppo_only[0] if args.ppo_only else 'demo'}.md").write_text(table + "\n")
    return 0 if all("failed" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
