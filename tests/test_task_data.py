"""tools/make_task_data.py for reasoning-gym tasks and the champ evaluation set: disjoint
splits, the columns the rewards read, and preference pairs the task's own scorer separates."""

import json

import pyarrow.parquet as pq
import pytest

from megatron_rlhf.rewards.registry import resolve
from tools.make_task_data import main


@pytest.mark.parametrize("task", ["gsm_symbolic", "basic_arithmetic", "chain_sum"])
def test_reasoning_gym_task_files(tmp_path, task):
    main(["--source", "reasoning-gym", "--task", task, "--n", "24", "--val", "8", "--seed", "1",
          "--out-dir", str(tmp_path)])
    train = pq.read_table(tmp_path / "prompts_train.parquet").to_pylist()
    val = pq.read_table(tmp_path / "prompts_val.parquet").to_pylist()
    assert len(train) == 24 and len(val) == 8
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    assert {"prompt", "ground_truth", "task", "metadata"} <= set(train[0])
    fn = resolve(f"reasoning_gym:{task}")
    for row in val:
        extra = {"task": row["task"], "metadata": row["metadata"]}
        assert isinstance(json.loads(row["metadata"]), dict)
        right = fn.score(f"<answer>{row['ground_truth']}</answer>", row["ground_truth"],
                         row["prompt"], extra)
        assert right[0] == 1.0
    prefs = pq.read_table(tmp_path / "prefs_train.parquet").to_pylist()
    assert prefs and all(p["chosen"] != p["rejected"] for p in prefs)
    sft = pq.read_table(tmp_path / "sft_train.parquet").to_pylist()
    assert sft[0]["response"] == f"<answer>{train[0]['ground_truth']}</answer>"


def test_champ_is_a_held_out_math_set(tmp_path):
    (path,) = main(["--source", "champ", "--out-dir", str(tmp_path)])
    rows = pq.read_table(path).to_pylist()
    assert len(rows) == 270 and len({r["identifier"] for r in rows}) == 270
    assert all(r["prompt"] and r["ground_truth"] for r in rows)
