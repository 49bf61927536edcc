"""The two CPU multi-agent runs of configs/multi_agent/, and their measured objectives.

    python benchmarks/multi_agent.py --demo runs/demo --work runs/multi_agent_bench

Needs a finished ``megatron-rlhf demo`` (its data, SFT policy and reward model).

1. ``population``: two agents from the demo's SFT policy trained together against the demo's
   reward model (configs/multi_agent/population_tiny_cpu.yaml). Objective: each agent's win rate
   against the frozen starting policy, measured by ``megatron-rlhf ab-test`` on the held-out
   prompts with the same reward model as judge (95% bootstrap interval over prompts).
2. ``proposer-solver`` (configs/multi_agent/proposer_solver_tiny_cpu.yaml): the proposer is first
   taught the task's question format (``make_task_data.py --proposer``, one SFT epoch from the
   demo's SFT policy; never on held-out questions), the solver starts from the SFT policy.
   Objective: the solver's held-out greedy solve rate (``val/oracle_acc``), before and after.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "megatron_rlhf.cli"]


def _run(args: list[str], log: Path) -> None:
    print(f"[bench] {' '.join(str(a) for a in args[3:6])} ... (log {log})", flush=True)
    with log.open("w") as handle:
        code = subprocess.call([str(a) for a in args], stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT)
    if code:
        sys.exit(f"{' '.join(str(a) for a in args[:5])} failed; see {log}")


def _newest(folder: Path) -> Path:
    return sorted(folder.glob("step_*"))[-1]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def population(demo: Path, work: Path, steps: int, extra: list[str]) -> dict:
    sft, rm = _newest(demo / "sft" / "checkpoints"), _newest(demo / "rm" / "checkpoints")
    out = work / "population"
    _run(CLI + ["ppo", "--config", "configs/multi_agent/population_tiny_cpu.yaml",
                f"data.train_files=[{demo / 'data' / 'prompts_train.parquet'}]",
                f"data.val_files=[{demo / 'data' / 'prompts_val.parquet'}]",
                f"agents.0.model_path={sft}", f"agents.1.model_path={sft}",
                f"reward.model_path={rm}", f"trainer.output_dir={out}",
                f"trainer.max_steps={steps}", *extra], work / "population.log")
    result = {"val": [{k: v for k, v in r.items() if "/val/" in k} | {"step": r["step"]}
                      for r in _rows(out) if any("/val/" in k for k in r)]}
    for name in ("a", "b"):
        ab = work / f"ab_{name}"
        _run(CLI + ["ab-test", "--policy-a", _newest(out / "agents" / name / "checkpoints" / "actor"),
                    "--policy-b", sft, "--prompts", demo / "data" / "prompts_val.parquet",
                    "--judge", f"rm:{rm}", "--samples-per-prompt", "4", "--temperature", "0.6",
                    "--max-new-tokens", "10", "--out", ab], work / f"ab_{name}.log")
        summary = json.loads((ab / "summary.json").read_text())
        result[f"{name}_vs_start"] = {k: summary[k] for k in ("win_rate", "score_difference",
                                                             "win", "tie", "loss")}
    return result


def proposer_solver(demo: Path, work: Path, steps: int, extra: list[str]) -> dict:
    data = work / "proposer_data"
    _run([sys.executable, "tools/make_task_data.py", "--out-dir", data, "--train", "4000", "--val",
          "200", "--proposer", "Write a question."], work / "proposer_data.log")
    _run(CLI + ["sft", "--config", "configs/sft/tiny_cpu.yaml", f"model.path={demo / 'sft_hf'}",
                f"data.train_files=[{data / 'proposer_train.parquet'}]",
                f"data.val_files=[{data / 'proposer_val.parquet'}]",
                f"trainer.output_dir={work / 'proposer_sft'}", "trainer.total_epochs=1"],
         work / "proposer_sft.log")
    out = work / "proposer_solver"
    _run(CLI + ["ppo", "--config", "configs/multi_agent/proposer_solver_tiny_cpu.yaml",
                f"data.train_files=[{demo / 'data' / 'prompts_train.parquet'}]",
                f"data.val_files=[{demo / 'data' / 'prompts_val.parquet'}]",
                f"agents.0.model_path={_newest(work / 'proposer_sft' / 'checkpoints')}",
                f"agents.1.model_path={_newest(demo / 'sft' / 'checkpoints')}",
                f"trainer.output_dir={out}", f"trainer.max_steps={steps}", *extra],
         work / "proposer_solver.log")
    rows = _rows(out)
    train = [r for r in rows if "proposer/valid_fraction" in r]
    window = max(1, len(train) // 6)

    def mean(key, part):
        values = [r[key] for r in part if key in r]
        return sum(values) / len(values) if values else float("nan")

    return {"solve_rate_val": [(r["step"], r["agent/solver/val/oracle_acc"]) for r in rows
                               if "agent/solver/val/oracle_acc" in r],
            "first_steps": {k: mean(k, train[:window]) for k in ("proposer/valid_fraction",
                                                                 "solver/solve_rate",
                                                                 "proposer/learnability_mean")},
            "last_steps": {k: mean(k, train[-window:]) for k in ("proposer/valid_fraction",
                                                                "solver/solve_rate",
                                                                "proposer/learnability_mean")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", default="runs/demo")
    parser.add_argument("--work", default="runs/multi_agent_bench")
    parser.add_argument("--only", choices=("population", "proposer-solver"), default=None)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("overrides", nargs="*", help="extra key=value for the runs")
    args = parser.parse_args()
    demo, work = Path(args.demo).resolve(), Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    if args.only in (None, "population"):
        results["population"] = population(demo, work, args.steps, args.overrides)
    if args.only in (None, "proposer-solver"):
        results["proposer-solver"] = proposer_solver(demo, work, args.steps, args.overrides)
    (work / "results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
