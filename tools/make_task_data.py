"""Write the bundled addition task as Parquet: preference pairs, PPO prompts and SFT pairs.

    python tools/make_task_data.py --out-dir data/addition [--train 20000 --val 500 --high 19]

Writes prefs_{train,val}.parquet (prompt, chosen, rejected), prompts_{train,val}.parquet
(prompt, ground_truth) and sft_{train,val}.parquet (prompt, response). Train and validation use
disjoint question sets: no validation question is ever trained on.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rlhf.data.task_files import write_task_files  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--train", type=int, default=20000, help="training rows")
    parser.add_argument("--val", type=int, default=500, help="validation rows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--high", type=int, default=19, help="largest operand")
    args = parser.parse_args()
    paths = write_task_files(args.out_dir, args.train, args.val, args.seed, args.high)
    print("\n".join(str(p) for p in paths))
