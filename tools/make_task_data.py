"""Write verifiable-task data as Parquet: PPO prompts, preference pairs and SFT pairs.

    python tools/make_task_data.py --out-dir data/addition [--train 20000 --val 500 --high 19]
    python tools/make_task_data.py --source reasoning-gym --task gsm_symbolic --n 2000 --seed 0 --out-dir data/gsm
    python tools/make_task_data.py --source champ --out-dir data/champ

``--source bundled`` (the default, the addition task) writes prefs_{train,val}.parquet (prompt,
chosen, rejected), prompts_{train,val}.parquet (prompt, ground_truth) and sft_{train,val}.parquet
(prompt, response). Train and validation use disjoint question sets: no validation question is
ever trained on.

``--source reasoning-gym --task T`` (any reasoning-gym task; gsm_symbolic, basic_arithmetic and
chain_sum are tested) writes the same files from the task's seeded generator: prompts carry
``task`` and ``metadata`` (JSON) columns, which ``reward.fn=reasoning_gym:T`` passes to the
task's scorer; the reply format is reasoning-gym's ``<answer>...</answer>``. Preference pairs
exist only for rows where the task's scorer gives the correct answer 1.0 and a near-miss number
less (so only tasks with numeric answers get them). Validation questions never occur in train.

``--source champ`` writes prompts_eval.parquet (prompt, ground_truth, identifier, category): the
270 competition-math problems of the champ-dataset package, a held-out evaluation set (use it as
``data.val_files`` with ``reward.oracle_fn=math``; some answers are free-form text that no
checker reads).
"""

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow as pa  # noqa: E402

from megatron_rlhf.data.parquet import write_table_atomic  # noqa: E402
from megatron_rlhf.data.task_files import write_task_files  # noqa: E402
from megatron_rlhf.errors import UserError  # noqa: E402


def _needs(package: str, module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise UserError(f"--source needs the {package} package ({err}); pip install {package}") from None


def reasoning_gym_rows(task: str, count: int, seed: int, system_prompt: str | None = None,
                       task_config: dict | None = None) -> list[dict]:
    """``count`` rows of distinct questions from the task's seeded generator, in its order;
    ``task_config``: the task config's fields (e.g. ``{"max_terms": 3}``)."""
    rg = _needs("reasoning-gym", "reasoning_gym")
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        raise UserError(f"--task {task!r} is not a reasoning-gym task")
    size = max(8, 3 * count)  # room for duplicates
    try:
        dataset = rg.create_dataset(task, size=size, seed=seed, **(task_config or {}))
    except (TypeError, ValueError, AssertionError) as err:
        raise UserError(f"reasoning-gym {task}: bad --task-config {task_config} ({err})") from None
    rows, seen = [], set()
    for index in range(size):
        entry = dataset[index]
        if entry["question"] in seen:
            continue
        seen.add(entry["question"])
        prompt = entry["question"] if system_prompt is None else [
            {"role": "system", "content": system_prompt}, {"role": "user", "content": entry["question"]}]
        rows.append({"prompt": prompt, "ground_truth": str(entry["answer"]), "task": task,
                     "metadata": json.dumps(entry["metadata"], default=str)})
        if len(rows) == count:
            return rows
    raise UserError(f"reasoning-gym {task}: only {len(rows)} distinct questions for {count} rows; "
                    "ask for fewer")


def near_miss(answer: str, rng: random.Random) -> str | None:
    """A plausible wrong number for a numeric answer (off by one or ten, one digit changed);
    None when the answer is not a number."""
    try:
        value = int(answer)
    except ValueError:
        try:
            return repr(float(answer) + rng.choice((-1, 1)))
        except ValueError:
            return None
    kind = rng.choice(("digit", "ten", "one"))
    if kind == "digit":
        digits = list(str(abs(value)))
        position = rng.randrange(len(digits))
        digits[position] = rng.choice([d for d in "0123456789" if d != digits[position]
                                       and not (position == 0 and d == "0" and len(digits) > 1)])
        wrong = int("".join(digits)) * (-1 if value < 0 else 1)
    else:
        wrong = value + rng.choice((-1, 1)) * (10 if kind == "ten" else 1)
    return str(wrong if wrong != value else value + 1)


def write_reasoning_gym(out_dir: str, task: str, train: int, val: int, seed: int,
                        system_prompt: str | None = None, task_config: dict | None = None) -> list[Path]:
    from megatron_rlhf.rewards.registry import as_score
    from megatron_rlhf.rewards.verifiable import ReasoningGymReward

    reward = ReasoningGymReward(task)
    # One stream of distinct questions, cut in two: no validation question is trained on.
    rows = reasoning_gym_rows(task, train + val, seed, system_prompt, task_config)
    train_rows, val_rows = rows[:train], rows[train:]
    out, paths, rng = Path(out_dir), [], random.Random(seed)
    for split, rows in (("train", train_rows), ("val", val_rows)):
        if not rows:
            continue
        prompts = {k: [r[k] for r in rows] for k in ("prompt", "ground_truth", "task", "metadata")}
        chosen = [f"<answer>{r['ground_truth']}</answer>" for r in rows]
        pairs = {"prompt": [], "chosen": [], "rejected": []}
        for row, good in zip(rows, chosen):
            wrong = near_miss(row["ground_truth"], rng)
            if wrong is None:
                continue
            bad = f"<answer>{wrong}</answer>"
            score = lambda reply: as_score(reward(  # noqa: E731
                reply, row["ground_truth"], _question(row), {"metadata": row["metadata"]}))[0]
            if score(good) == 1.0 and score(bad) < 1.0:
                for key, value in (("prompt", row["prompt"]), ("chosen", good), ("rejected", bad)):
                    pairs[key].append(value)
        files = {f"prompts_{split}.parquet": prompts,
                 f"sft_{split}.parquet": {"prompt": prompts["prompt"], "response": chosen}}
        if pairs["prompt"]:
            files[f"prefs_{split}.parquet"] = pairs
        else:
            print(f"{task} {split}: no preference pairs (the scorer does not separate a correct "
                  "answer from a near miss)", file=sys.stderr)
        for name, columns in files.items():
            write_table_atomic(pa.table(columns), out / name)
            paths.append(out / name)
    return paths


def _question(row: dict) -> str:
    prompt = row["prompt"]
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


def write_champ(out_dir: str, count: int | None) -> list[Path]:
    champ = _needs("champ-dataset", "champ_dataset")
    problems = list(champ.load("v0").problems.values())[:count]
    columns = {"prompt": [p.text for p in problems], "ground_truth": [p.answer for p in problems],
               "identifier": [p.identifier for p in problems],
               "category": [p.category for p in problems]}
    path = Path(out_dir) / "prompts_eval.parquet"
    write_table_atomic(pa.table(columns), path)
    return [path]


def main(argv=None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--source", choices=("bundled", "reasoning-gym", "champ"), default="bundled")
    parser.add_argument("--task", help="reasoning-gym task, e.g. gsm_symbolic, basic_arithmetic, chain_sum")
    parser.add_argument("--train", "--n", dest="train", type=int, default=None,
                        help="training rows (bundled: 20000, reasoning-gym: 1000; champ: all 270)")
    parser.add_argument("--val", type=int, default=None,
                        help="validation rows (bundled: 500, reasoning-gym: 100)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--high", type=int, default=19, help="bundled: largest operand")
    parser.add_argument("--system-prompt", default=None,
                        help="reasoning-gym: write chat prompts with this reasoning_gym.utils."
                             "SYSTEM_PROMPTS entry (e.g. default) as the system message")
    parser.add_argument("--task-config", type=json.loads, default=None,
                        help='reasoning-gym: the task config\'s fields as JSON, e.g. \'{"max_terms": 3}\'')
    parser.add_argument("--proposer", metavar="INSTRUCTION", default=None,
                        help="bundled: also write proposer_{train,val}.parquet, SFT pairs "
                             "INSTRUCTION -> a training question (a proposer-solver run's proposer)")
    args = parser.parse_args(argv)
    if args.source == "bundled":
        train, val = 20000 if args.train is None else args.train, 500 if args.val is None else args.val
        paths = write_task_files(args.out_dir, train, val, args.seed, args.high)
        if args.proposer:
            from megatron_rlhf.data.task_files import write_proposer_files

            paths += write_proposer_files(args.out_dir, args.proposer, train, val, args.seed, args.high)
        return paths
    if args.source == "champ":
        return write_champ(args.out_dir, args.train)
    if not args.task:
        parser.error("--source reasoning-gym needs --task")
    system = None
    if args.system_prompt:
        from reasoning_gym.utils import SYSTEM_PROMPTS

        if args.system_prompt not in SYSTEM_PROMPTS:
            parser.error(f"--system-prompt must be one of {', '.join(SYSTEM_PROMPTS)}")
        system = SYSTEM_PROMPTS[args.system_prompt]
    return write_reasoning_gym(args.out_dir, args.task, 1000 if args.train is None else args.train,
                               100 if args.val is None else args.val, args.seed, system,
                               args.task_config)


if __name__ == "__main__":
    try:
        paths = main()
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print("\n".join(str(p) for p in paths))
