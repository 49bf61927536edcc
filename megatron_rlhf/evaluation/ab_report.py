"""The A/B report: one Parquet row per (A, B) pair, a JSON summary, a PNG, the printed summary.

Written by rank 0 once everything is generated and judged; ``summary.json`` is written last, so a
folder with it is a complete report.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa

from megatron_rlhf.evaluation.ab_stats import summarize

FILES = {"rows": "pairs.parquet", "summary": "summary.json", "figure": "ab_test.png"}
OUTCOMES = {1.0: "win", 0.5: "tie", 0.0: "loss"}
INTERVAL = "percentile bootstrap over prompts (a prompt's samples are resampled together)"
TESTS = ("sign test: exact two-sided binomial over prompts (a prompt is a win for A when its "
         "mean outcome is above 1/2; prompts at exactly 1/2 dropped); permutation test: paired "
         "sign flips of each prompt's mean score difference, statistic |mean difference|")
LENGTH_CONTROL = (
    "logistic regression of each pair's outcome (1 win, 1/2 tie, 0 loss) on tanh(D / sd(D)), "
    "D = response characters of A minus B, reporting the fitted win rate at D = 0 with a "
    "bootstrap interval over prompts. A regression rather than length strata: it uses every "
    "pair, needs no bin edges and answers 'at equal length' directly (AlpacaEval 2 does the "
    "same); tanh bounds the pull of a few very long replies; characters, not tokens, because A "
    "and B may use different tokenizers.")


def _prompt_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def rows_table(inputs, samples: dict, scores: dict, k: int) -> pa.Table:
    """One row per pair, prompt-major: prompt, both responses, scores, lengths, outcome."""
    count = len(samples["a"].tokens)
    prompts = [i // k for i in range(count)]
    outcome = np.where(scores["score"]["a"] > scores["score"]["b"], 1.0,
                       np.where(scores["score"]["a"] < scores["score"]["b"], 0.0, 0.5))
    columns = {"prompt_index": prompts, "sample_index": [i % k for i in range(count)],
               "prompt": [_prompt_text(inputs.prompt_values[p]) for p in prompts]}
    if any(t is not None for t in inputs.truths):
        columns["ground_truth"] = [inputs.truths[p] for p in prompts]
    for side in ("a", "b"):
        columns[f"response_{side}"] = samples[side].texts
    for side in ("a", "b"):
        columns[f"score_{side}"] = scores["score"][side].tolist()
    if len(inputs.judge.parts) > 1:
        for part in inputs.judge.parts:
            for side in ("a", "b"):
                columns[f"{part}_score_{side}"] = scores[part][side].tolist()
    for side in ("a", "b"):
        columns[f"tokens_{side}"] = [len(t) for t in samples[side].tokens]
        columns[f"chars_{side}"] = [len(t) for t in samples[side].texts]
        columns[f"finished_{side}"] = samples[side].finished
    columns["outcome"] = [OUTCOMES[v] for v in outcome.tolist()]
    columns["outcome_value"] = outcome.tolist()
    return pa.table(columns)


def build_summary(inputs, table: pa.Table, args) -> dict:
    """The JSON summary: settings, method notes, and :func:`summarize` of the rows (per judge
    too when there are two)."""
    shape = (len(inputs.prompt_values), args.samples_per_prompt)
    column = lambda name: np.asarray(table.column(name).to_pylist(), dtype=float).reshape(shape)  # noqa: E731
    lengths = (column("chars_a"), column("chars_b"))
    options = dict(num_resamples=args.num_resamples, seed=args.seed)
    stats = summarize(column("score_a"), column("score_b"), *lengths, **options)
    per_judge = {}
    if len(inputs.judge.parts) > 1:
        per_judge = {part: summarize(column(f"{part}_score_a"), column(f"{part}_score_b"),
                                     *lengths, **options) for part in inputs.judge.parts}
    return {
        "policy_a": str(inputs.policies["a"].path), "policy_b": str(inputs.policies["b"].path),
        "prompts": str(args.prompts), "judge": inputs.judge.spec,
        "score": " + ".join(inputs.judge.parts),
        "samples_per_prompt": args.samples_per_prompt, "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens, "seed": args.seed,
        **stats,
        "mean_chars_a": float(lengths[0].mean()), "mean_chars_b": float(lengths[1].mean()),
        "mean_tokens_a": float(column("tokens_a").mean()),
        "mean_tokens_b": float(column("tokens_b").mean()),
        "unfinished_a": float(1 - column("finished_a").mean()),
        "unfinished_b": float(1 - column("finished_b").mean()),
        "per_judge": per_judge,
        "methods": {"interval": INTERVAL, "win_rate": "ties count half", "tests": TESTS,
                    "length_control": LENGTH_CONTROL},
        "files": dict(FILES),
    }


def plot(summary: dict, table: pa.Table, path: Path) -> None:
    """Win rate (plain and length-controlled) with intervals, score differences, lengths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    names = ("win_rate", "length_controlled_win_rate")
    points = [summary[n] for n in names]
    errors = [[p["estimate"] - p["low"] for p in points], [p["high"] - p["estimate"] for p in points]]
    axes[0].errorbar([0, 1], [p["estimate"] for p in points], yerr=errors, fmt="o", capsize=8)
    axes[0].axhline(0.5, color="gray", linestyle="--", linewidth=1)
    axes[0].set(xticks=[0, 1], xticklabels=["win rate", "length-controlled"], xlim=(-0.5, 1.5),
                ylim=(0, 1), title=f"A vs B ({int(100 * summary['level'])}% interval over prompts)")
    diffs = np.asarray(table.column("score_a").to_pylist()) - np.asarray(table.column("score_b").to_pylist())
    axes[1].hist(diffs, bins=min(40, max(5, len(diffs) // 4)), color="tab:blue", alpha=0.8)
    axes[1].axvline(0, color="gray", linestyle="--", linewidth=1)
    axes[1].axvline(float(diffs.mean()), color="tab:red", linewidth=1.5, label="mean")
    axes[1].set(title=f"score difference A - B ({summary['score']})", xlabel="per pair")
    axes[1].legend()
    chars_a, chars_b = (table.column(c).to_pylist() for c in ("chars_a", "chars_b"))
    axes[2].scatter(chars_b, chars_a, s=12, alpha=0.5)
    top = max(chars_a + chars_b + [1])
    axes[2].plot([0, top], [0, top], color="gray", linestyle="--", linewidth=1)
    axes[2].set(title="response length (characters)", xlabel="B", ylabel="A")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(inputs, samples: dict, scores: dict, args) -> dict:
    """Write the three files into ``inputs.out`` (summary last) and return the summary."""
    from megatron_rlhf.data.parquet import write_table_atomic

    table = rows_table(inputs, samples, scores, args.samples_per_prompt)
    summary = build_summary(inputs, table, args)
    inputs.out.mkdir(parents=True, exist_ok=True)
    write_table_atomic(table, inputs.out / FILES["rows"])
    plot(summary, table, inputs.out / FILES["figure"])
    partial = inputs.out / (FILES["summary"] + ".partial")
    partial.write_text(json.dumps(summary, indent=2))
    partial.replace(inputs.out / FILES["summary"])
    summary["out"] = str(inputs.out)
    return summary


def _interval(value: dict, digits: int = 3) -> str:
    return (f"{value['estimate']:+.{digits}f} [{value['low']:+.{digits}f}, {value['high']:+.{digits}f}]"
            if value["low"] < 0 or value["estimate"] < 0 else
            f"{value['estimate']:.{digits}f} [{value['low']:.{digits}f}, {value['high']:.{digits}f}]")


def _statistics_lines(s: dict, indent: str = "  ") -> list[str]:
    sign = s["sign_test"]
    return [
        f"{indent}A win / tie / loss:         {s['win']:.3f} / {s['tie']:.3f} / {s['loss']:.3f}",
        f"{indent}A win rate (ties half):     {_interval(s['win_rate'])}",
        f"{indent}mean score A - B:           {_interval(s['score_difference'])}   "
        f"(A {s['mean_score_a']:.4g}, B {s['mean_score_b']:.4g})",
        f"{indent}sign test over prompts:     {sign['wins']} A / {sign['losses']} B / "
        f"{sign['ties']} even, p = {sign['p_value']:.3g} (exact binomial)",
        f"{indent}paired permutation test:    p = {s['permutation_p_value']:.3g}",
        f"{indent}length-controlled win rate: {_interval(s['length_controlled_win_rate'])}   "
        f"(log-odds slope {s['length_slope']:+.3f})",
    ]


def format_summary(summary: dict) -> str:
    """The printed summary (what the command shows at the end)."""
    s = summary
    lines = [
        f"ab-test: {s['num_prompts']} prompts x {s['samples_per_prompt']} samples = "
        f"{s['num_pairs']} pairs; judge {s['judge']}; temperature {s['temperature']:g}",
        f"  A = {s['policy_a']}",
        f"  B = {s['policy_b']}",
        f"  intervals: {int(100 * s['level'])}% {INTERVAL.split(' (')[0]}, "
        f"{s['num_resamples']} resamples",
        *_statistics_lines(s),
        f"  response length (chars):    A {s['mean_chars_a']:.1f}, B {s['mean_chars_b']:.1f}; "
        f"hit --max-new-tokens: A {s['unfinished_a']:.1%}, B {s['unfinished_b']:.1%}",
    ]
    for part, stats in s["per_judge"].items():
        lines += [f"  judge {part} alone:", *_statistics_lines(stats, "    ")]
    if "out" in s:
        lines.append(f"wrote {', '.join(FILES.values())} to {s['out']}")
    return "\n".join(lines)
