"""A task where tools matter (issue 37 item 6): three-digit sums, which the tiny policy cannot add
by itself, and a ``calculator`` it can call.

    python benchmarks/tools_demo.py --work /tmp/tools_demo --seeds 0 1 2

Per seed (the model's; the data is fixed): the task's data and a tiny base with a tool-carrying
chat template (:func:`megatron_rlhf.demo.prepare_tool_task`), a short SFT on traces a
``--tool-fraction`` of which call the calculator (the rest answer directly) (``configs/sft/tools_tiny_cpu.yaml``), then two GRPO runs from that SFT
policy with the same budget (``configs/ppo/tools_grpo_tiny_cpu.yaml``), rewarded by the task's
checker: one with ``rollout.tools`` (the calculator), one without (``rollout.tools=[]``: the
prompts do not show it and a call is never answered). Held-out accuracy is greedy, on questions
never trained on, at GRPO step 0 (the SFT policy) and at the end; one row per seed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from megatron_rlhf.demo import CONFIGS, _curves, _newest, _stage, fresh_out_dir, prepare_tool_task

RUNS = {"tools": (), "no_tools": ("rollout.tools=[]",)}


def run_seed(root: Path, seed: int, tool_fraction: float, overrides: tuple[str, ...]) -> dict:
    """Data, base, SFT and both GRPO runs of one seed under ``root``; their accuracy curves."""
    start = time.time()
    prepare_tool_task(root, seed, tool_fraction=tool_fraction)
    data = root / "data"
    _stage(root, "sft", [
        "sft", "--config", str(CONFIGS / "sft" / "tools_tiny_cpu.yaml"), f"model.path={root / 'base'}",
        f"data.train_files=[{data / 'sft_train.parquet'}]", f"data.val_files=[{data / 'sft_val.parquet'}]",
        f"trainer.output_dir={root / 'sft'}", "trainer.logger=console", f"trainer.seed={1 + seed}"])
    row = {"seed": seed}
    for name, extra in RUNS.items():
        out = root / f"grpo_{name}"
        _stage(root, out.name, [
            "ppo", "--config", str(CONFIGS / "ppo" / "tools_grpo_tiny_cpu.yaml"),
            f"actor.model_path={_newest(root / 'sft')}", f"data.train_files=[{data / 'prompts_train.parquet'}]",
            f"data.val_files=[{data / 'prompts_val.parquet'}]", f"trainer.output_dir={out}",
            "trainer.logger=console", f"trainer.seed={1 + seed}", f"rollout.seed={seed}", *extra, *overrides])
        row[name] = [round(v, 3) for _, v in _curves(out / "metrics.jsonl")["val/oracle_acc"]]
    row["seconds"] = time.time() - start
    print(json.dumps(row), flush=True)
    return row


def report(rows: list[dict]) -> str:
    lines = ["| seed | with tools: start | with tools: end | change (points) | without tools: start | "
             "without tools: end | wall s | with tools, each validation |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tools, plain = r["tools"], r["no_tools"]
        lines.append(f"| {r['seed']} | {tools[0]:.3f} | {tools[-1]:.3f} | {100 * (tools[-1] - tools[0]):+.1f} | "
                     f"{plain[0]:.3f} | {plain[-1]:.3f} | {r['seconds']:.0f} | {' '.join(f'{v:.3f}' for v in tools)} |")
    gains = [100 * (r["tools"][-1] - r["tools"][0]) for r in rows]
    lines.append(f"\nchange with tools over {len(rows)} seeds: min {min(gains):+.1f}, median "
                 f"{statistics.median(gains):+.1f}, max {max(gains):+.1f} points")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, help="folder for the runs (one subfolder a seed)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tool-fraction", type=float, default=0.4,
                        help="share of the SFT traces that call the calculator")
    parser.add_argument("overrides", nargs="*", help="extra key=value for both GRPO runs")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = [run_seed(fresh_out_dir(str(work / f"seed{seed}")), seed, args.tool_fraction,
                    tuple(args.overrides))
            for seed in args.seeds]
    table = report(rows)
    print(table)
    (work / "tools_demo.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
