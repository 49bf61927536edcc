"""Writing the bundled task's Parquet files (used by tools/make_task_data.py and the demo)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from megatron_rlhf.data.parquet import write_table_atomic
from megatron_rlhf.data.tasks import AdditionTask, make_rows, split_operands, tool_trace


def write_task_files(out_dir: str, train: int, val: int, seed: int = 0, high: int = 19,
                     val_fraction: float = 0.1) -> list[Path]:
    """Train and validation rows from disjoint question sets (``val_fraction`` held out)."""
    train_ops, val_ops = split_operands(AdditionTask(high=high), val_fraction, seed)
    out = Path(out_dir)
    splits = {"train": make_rows(train_ops, train, seed + 1),
              "val": make_rows(val_ops, val, seed + 2)}
    paths = []
    for split, rows in splits.items():
        files = {
            f"prefs_{split}.parquet": {k: rows[k] for k in ("prompt", "chosen", "rejected")},
            f"prompts_{split}.parquet": {k: rows[k] for k in ("prompt", "ground_truth")},
            f"sft_{split}.parquet": {"prompt": rows["prompt"], "response": rows["chosen"]},
        }
        for name, columns in files.items():
            write_table_atomic(pa.table(columns), out / name)
            paths.append(out / name)
    return paths


def write_proposer_files(out_dir: str, instruction: str, train: int, val: int, seed: int = 0,
                         high: int = 19, val_fraction: float = 0.1) -> list[Path]:
    """SFT pairs that teach a proposer the task's format: ``instruction`` -> a question
    (``proposer_{train,val}.parquet``), drawn from the same training operands as
    :func:`write_task_files` with these arguments, never from the held-out ones."""
    import random

    train_ops, _ = split_operands(AdditionTask(high=high), val_fraction, seed)
    rng = random.Random(seed + 3)
    paths = []
    for split, count in (("train", train), ("val", val)):
        questions = [AdditionTask.question(*rng.choice(train_ops))[0] for _ in range(count)]
        path = Path(out_dir) / f"proposer_{split}.parquet"
        write_table_atomic(pa.table({"prompt": [instruction] * count, "response": questions}), path)
        paths.append(path)
    return paths


def write_tool_task_files(out_dir: str, train: int, val: int, seed: int = 0, low: int = 100,
                          high: int = 999, tool_fraction: float = 0.5,
                          val_fraction: float = 0.1) -> list[Path]:
    """The addition task with operands in ``[low, high]`` (three digits: more than a tiny model
    adds by itself) for a policy with a ``calculator``: RL prompts (``prompts_{train,val}``:
    prompt, ground_truth) and SFT traces (``sft_{train,val}``: the question and a response of
    messages, :func:`~megatron_rlhf.data.tasks.tool_trace`), a ``tool_fraction`` of them calling
    the tool and the rest answering directly. Validation questions are never trained on."""
    import random

    train_ops, val_ops = split_operands(AdditionTask(low, high), val_fraction, seed)
    out, paths = Path(out_dir), []
    for split, ops, count, offset in (("train", train_ops, train, 1), ("val", val_ops, val, 2)):
        rng = random.Random(seed + offset)
        drawn = [rng.choice(ops) for _ in range(count)]
        prompts = [AdditionTask.question(a, b)[0] for a, b in drawn]
        traces = [tool_trace(a, b, rng.random() < tool_fraction) for a, b in drawn]
        files = {f"prompts_{split}.parquet": {"prompt": prompts,
                                              "ground_truth": [str(a + b) for a, b in drawn]},
                 f"sft_{split}.parquet": {"prompt": prompts, "response": traces}}
        for name, columns in files.items():
            write_table_atomic(pa.table(columns), out / name)
            paths.append(out / name)
    return paths
