"""Writing the bundled task's Parquet files (used by tools/make_task_data.py and the demo)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from megatron_rlhf.data.parquet import write_table_atomic
from megatron_rlhf.data.tasks import AdditionTask, make_rows


def write_task_files(out_dir: str, train: int, val: int, seed: int = 0, high: int = 99) -> list[Path]:
    task = AdditionTask(high=high)
    out = Path(out_dir)
    splits = {"train": make_rows(task, train, seed), "val": make_rows(task, val, seed + 1)}
    seen = set(splits["train"]["prompt"])
    keep = [i for i, p in enumerate(splits["val"]["prompt"]) if p not in seen]
    splits["val"] = {k: [v[i] for i in keep] for k, v in splits["val"].items()}
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
