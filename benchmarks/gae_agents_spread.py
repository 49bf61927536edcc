"""Spread of the two-player GAE acceptance run (tests/test_multi_agent.py,
``test_an_answerer_with_a_critic_of_its_own_learns_in_critique_revise``) over seeds and
thread counts: the answerer's critic loss (last half / first half of the steps) and its reward
gain (last-half mean minus first-half mean). The test's bars sit below the worst run here.

    python benchmarks/gae_agents_spread.py [--seeds 0 1 2] [--threads 1 2]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    from tests import test_multi_agent as t

    with tempfile.TemporaryDirectory() as tmp:
        ws = t.build_workspace(Path(tmp) / "ws")
        print("| seed | threads | vf_loss last/first | reward first -> last | gain |")
        print("|---:|---:|---:|---:|---:|")
        for seed in args.seeds:
            for threads in args.threads:
                out = Path(tmp) / f"run_{seed}_{threads}"
                extra = [f"trainer.seed={seed}", f"rollout.seed={seed}"]
                env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
                done = subprocess.run([sys.executable, "-m", "megatron_rlhf.cli", "ppo",
                                       *t.overrides(ws, out, *t.GAE_OVERRIDES(ws), *t.GAE_RUN, *extra)],
                                      cwd=ROOT, capture_output=True, text=True, env=env)
                if done.returncode != 0:
                    print(done.stdout[-2000:], done.stderr[-2000:])
                    raise SystemExit(1)
                rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
                steps = [r for r in rows if "agent/a/critic/vf_loss" in r]
                half = len(steps) // 2
                mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
                vf = mean(steps[-half:], "agent/a/critic/vf_loss") / mean(steps[:half], "agent/a/critic/vf_loss")
                first = mean(steps[:half], "agent/a/reward/score_mean")
                last = mean(steps[-half:], "agent/a/reward/score_mean")
                print(f"| {seed} | {threads} | {vf:.3f} | {first:.4f} -> {last:.4f} | {last - first:+.4f} |",
                      flush=True)


if __name__ == "__main__":
    main()
