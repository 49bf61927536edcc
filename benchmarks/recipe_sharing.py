"""Seconds per trained sample of the real-model recipe, each prompt computed once vs padded copies.

The recipe: `configs/ppo/smollm2_cpu.yaml` (SmolLM2-135M-Instruct, chain_sum, reward = checker +
0.25 x a Bradley-Terry reward model) with its GRPO-group settings (docs/smollm2.md, run 4:
groups of 8, 8 prompts a step, two optimizer steps of 32). Two arms, one after the other in one
command, same model, data, seed and threads:

- ``padded``: the config as it was (``data.use_remove_padding=false``: every sample its own
  padded row, each carrying a copy of its prompt);
- ``shared``: packed rows with each group's prompt once (``data.use_remove_padding=true``,
  ``data.share_prompts`` at its default), in the old-log-prob, reference, reward-model and
  update passes, and the hf engine prefilling a prompt once for its samples.

The policy starts from the exported SmolLM2 and the reward model from one train-rm step on the
task's pairs (throughput does not depend on how well either is trained). A step's seconds are the
sum of its ``timing/*`` phases; the first ``--warmup`` steps are left out.

    python benchmarks/recipe_sharing.py [--steps 3] [--warmup 1] [--threads 2] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RUN4 = ("algorithm.adv_estimator=grpo", "rollout.n=8", "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=32", "actor.ppo_micro_batch_size_per_rank=32",
        "actor.ppo_epochs=1", "actor.optim.lr=5e-6", "actor.use_kl_loss=true",
        "actor.kl_loss_coef=0.001", "algorithm.use_kl_in_reward=false")
ARMS = {"padded": ("data.use_remove_padding=false",), "shared": ("data.use_remove_padding=true",)}


def cli(args: list[str], env: dict, log: Path) -> None:
    with log.open("w") as out:
        proc = subprocess.run([sys.executable, "-m", "megatron_rlhf.cli", *args], env=env, cwd=ROOT,
                              stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise RuntimeError(f"{args[0]} failed; see {log}:\n{log.read_text()[-3000:]}")


def prepare(work: Path, env: dict) -> tuple[Path, Path, Path]:
    from megatron_rlhf.demo import _newest
    from megatron_rlhf.demo_smollm2 import SYSTEM_PROMPT, TASK, TASK_CONFIG
    from tools.export_smollm2 import export_smollm2

    base, data = work / "smollm2", work / "data"
    if not (base / "config.json").is_file():
        export_smollm2(str(base))
    if not (data / "prompts_train.parquet").is_file():
        subprocess.run([sys.executable, str(ROOT / "tools" / "make_task_data.py"), "--source",
                        "reasoning-gym", "--task", TASK, "--task-config", json.dumps(TASK_CONFIG),
                        "--train", "400", "--val", "8", "--seed", "0", "--system-prompt",
                        SYSTEM_PROMPT, "--out-dir", str(data)], check=True, env=env, cwd=ROOT,
                       capture_output=True)
    if not (work / "rm").is_dir():
        cli(["train-rm", "--config", "configs/rm/smollm2_cpu.yaml", f"model.path={base}",
             f"data.train_files=[{data / 'prefs_train.parquet'}]", "data.val_files=[]",
             f"trainer.output_dir={work / 'rm'}", "trainer.max_steps=1",
             "trainer.save_every_steps=1"], env, work / "rm.log")
    return base, data, _newest(work / "rm")


def run_arm(name: str, work: Path, base: Path, data: Path, rm: Path, args, env: dict) -> dict:
    out = work / f"ppo_{name}"
    cli(["ppo", "--config", "configs/ppo/smollm2_cpu.yaml", f"actor.model_path={base}",
         f"critic.model_path={rm}", f"reward.model_path={rm}",
         f"data.train_files=[{data / 'prompts_train.parquet'}]", "data.val_files=[]",
         f"trainer.output_dir={out}", f"trainer.max_steps={args.steps}", "trainer.eval_every_steps=0",
         "trainer.val_before_train=false", "trainer.save_every_steps=0", "trainer.logger=console",
         "trainer.rollback.kl_threshold=0", *RUN4, *ARMS[name]], env, work / f"ppo_{name}.log")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing/gen" in r][args.warmup:]
    samples = 8 * 8
    seconds = [sum(v for k, v in r.items() if k.startswith("timing/")) for r in rows]
    phases = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0] if k.startswith("timing/")}
    return {"s_per_step": sum(seconds) / len(seconds), "s_per_sample": sum(seconds) / len(seconds) / samples,
            "phases": phases, "steps": len(rows),
            "tokens_computed": sum(r.get("actor/tokens_computed", 0) for r in rows) / len(rows),
            "tokens_sample": sum(r.get("actor/tokens_sample", 0) for r in rows) / len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", default=None, help="reused between calls (model, data, RM)")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="recipe_sharing_"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    base, data, rm = prepare(work, env)
    results = {name: run_arm(name, work, base, data, rm, args, env) for name in ARMS}
    print(json.dumps(results, indent=1))
    padded, shared = results["padded"], results["shared"]
    print(f"padded {padded['s_per_sample']:.3f} s/sample, shared {shared['s_per_sample']:.3f} s/sample: "
          f"{padded['s_per_sample'] / shared['s_per_sample']:.2f}x; actor tokens computed "
          f"{shared['tokens_computed']:.0f} of {shared['tokens_sample']:.0f}")


if __name__ == "__main__":
    main()
