"""Training mixture-of-experts models at EP=2: SFT with load-balancing and z-losses (logged,
resumed exactly, reloaded at EP=1 and TP=2 with sequence parallelism), a DeepSeek-V3 reward
model, PPO with a critic (Qwen3-MoE) and GRPO (DeepSeek-V3) whose engine matches the trainer."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SFT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "sft" / "tiny_cpu.yaml"


@pytest.fixture(scope="module")
def moe_workspaces(tmp_path_factory):
    from tests.tiny_models import build_task_workspace

    root = tmp_path_factory.mktemp("moe")
    return {family: build_task_workspace(root / family, train=256, val=16, seed=0, family=family)
            for family in ("qwen3_moe", "deepseek_v3")}


def cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "megatron_rlhf.cli", *args], capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def sft_args(ws: Path, out: Path, *extra: str, nproc: int = 2) -> list[str]:
    data = ws / "data"
    return ["sft", "--config", str(SFT_CONFIG), f"model.path={ws / 'base'}",
            f"data.train_files=[{data / 'sft_train.parquet'}]", f"data.val_files=[{data / 'sft_val.parquet'}]",
            f"trainer.output_dir={out}", "data.train_batch_size=16", "data.micro_batch_size_per_rank=4",
            "trainer.save_every_steps=2", "trainer.log_every_steps=1", "model.moe.aux_loss_coef=0.01",
            "model.moe.z_loss_coef=0.001", *extra, "--nproc-per-node", str(nproc)]


def sft(ws: Path, out: Path, *extra: str, nproc: int = 2) -> list[dict]:
    cli(*sft_args(ws, out, *extra, nproc=nproc))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def sft_ep2(moe_workspaces, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft_ep2")
    return out, sft(moe_workspaces["qwen3_moe"], out, "trainer.max_steps=4", "parallel.ep=2")


def test_moe_losses_enter_the_objective_and_are_logged(sft_ep2):
    out, rows = sft_ep2
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"moe/load_balancing_loss", "moe/z_loss", "moe/tokens_per_expert_max_over_mean"} <= tags
    first = rows[0]
    # Switch-transformer balance loss is 1 when routing is uniform; a random router is near it.
    assert 0.9 < first["moe/load_balancing_loss"] < 2.0 and first["moe/z_loss"] > 0
    assert first["moe/tokens_per_expert_max_over_mean"] >= 1.0
    assert rows[-1]["train/loss"] < first["train/loss"]  # it learns


def test_kill_9_at_ep2_and_resume_reproduces_the_run_exactly(sft_ep2, moe_workspaces, tmp_path):
    """kill -9 once step 3 is logged (after the step-2 save); the rerun resumes from step 2 and
    logs the uninterrupted run's losses bit for bit (same process layout). The signal reaches
    the launcher alone (torch elastic gives each rank a session of its own): the ranks must die
    with it, or they finish the run on their own before the rerun starts."""
    import os
    import signal
    import time

    _, straight = sft_ep2
    out = tmp_path / "killed"
    args = sft_args(moe_workspaces["qwen3_moe"], out, "trainer.max_steps=4", "parallel.ep=2")
    proc = subprocess.Popen([sys.executable, "-m", "megatron_rlhf.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    metrics, deadline = out / "metrics.jsonl", time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    resumed = cli(*args)
    assert "resumed from" in resumed.stdout
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["train/loss"] for r in rows] == [r["train/loss"] for r in straight]


def test_resume_across_expert_layouts_is_refused_and_the_weights_start_a_new_run(
        sft_ep2, moe_workspaces, tmp_path):
    """EP=2 chains a second optimizer for the experts, EP=1 has one: the training state cannot
    follow (one clear line), the weights can (resharded on load; parity in test_families)."""
    import shutil

    source, _ = sft_ep2
    ws, out = moe_workspaces["qwen3_moe"], tmp_path / "relayout"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / "step_00000002", out / "checkpoints" / "step_00000002")
    data = ws / "data"
    proc = subprocess.run([sys.executable, "-m", "megatron_rlhf.cli", "sft", "--config", str(SFT_CONFIG),
                           f"model.path={ws / 'base'}", f"data.train_files=[{data / 'sft_train.parquet'}]",
                           f"data.val_files=[{data / 'sft_val.parquet'}]",
                           f"trainer.output_dir={out}", "data.train_batch_size=16",
                           "data.micro_batch_size_per_rank=4", "trainer.max_steps=4"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "chained optimizer" in proc.stderr.splitlines()[-1]
    for layout, nproc in ((("parallel.ep=1",), 1),
                          (("parallel.tp=2", "parallel.sequence_parallel=true"), 2)):
        fresh = tmp_path / f"fresh_{nproc}"
        cli("sft", "--config", str(SFT_CONFIG),
            f"model.path={source / 'checkpoints' / 'step_00000004'}",
            f"data.train_files=[{data / 'sft_train.parquet'}]", "data.val_files=[]",
            f"trainer.output_dir={fresh}",
            "data.train_batch_size=16", "data.micro_batch_size_per_rank=4", "trainer.max_steps=1",
            *layout, "--nproc-per-node", str(nproc))
        assert (fresh / "checkpoints" / "step_00000001").is_dir()


def test_deepseek_v3_reward_model_trains_at_ep2(moe_workspaces, tmp_path):
    ws, out = moe_workspaces["deepseek_v3"], tmp_path / "rm"
    data = ws / "data"
    cli("train-rm", "--config", str(SFT_CONFIG.parents[1] / "rm" / "tiny_cpu.yaml"),
        f"model.path={ws / 'base'}", f"data.train_files=[{data / 'prefs_train.parquet'}]",
        f"data.val_files=[{data / 'prefs_val.parquet'}]", f"trainer.output_dir={out}",
        "data.train_batch_size=16", "data.micro_batch_size_per_rank=4", "trainer.max_steps=6",
        "trainer.log_every_steps=1", "parallel.ep=2", "parallel.use_distributed_optimizer=true",
        "--nproc-per-node", "2")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # The aux-loss-free balancer moved the router's expert bias after the first step.
    assert rows[-1]["moe/expert_bias_spread"] > 0
    assert sum(r["train/loss"] for r in rows[-2:]) < sum(r["train/loss"] for r in rows[:2])
    final = json.loads((out / "final_metrics.json").read_text())
    assert final["step"] == 6 and "val/accuracy" in final  # validated after the last step


def ppo(ws: Path, out: Path, *extra: str) -> list[dict]:
    data = ws / "data"
    cli("ppo", "--config", str(SFT_CONFIG.parents[1] / "ppo" / "tiny_cpu.yaml"),
        f"actor.model_path={ws / 'base'}", f"critic.model_path={ws / 'base'}", "reward.model_path=null",
        "reward.fn=addition", f"data.train_files=[{data / 'prompts_train.parquet'}]",
        f"data.val_files=[{data / 'prompts_val.parquet'}]", f"trainer.output_dir={out}",
        "trainer.max_steps=2", "trainer.n_gpus_per_node=2", "actor.parallel.ep=2",
        "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_rank=4",
        "actor.ppo_epochs=2", "trainer.eval_every_steps=0", "trainer.val_before_train=false",
        "actor.moe.aux_loss_coef=0.01", "rollout.temperature=0.7", *extra, timeout=900)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("family, extra", [
    # GAE with a Qwen3-MoE critic; a bf16 engine beside the fp32 trainer: some tokens route
    # differently, R3 runs the engine's experts.
    # (64 samples a step: ~0.3% of ~2,600 token-layer pairs flip, measured; enough for some.)
    ("qwen3_moe", ("actor.router_replay=R3", "rollout.dtype=bfloat16", "rollout.n=4",
                   "data.train_batch_size=16")),
    ("deepseek_v3", ("algorithm.adv_estimator=grpo", "rollout.n=2", "actor.router_replay=R2")),
])
def test_ppo_trains_moe_policies_at_ep2(moe_workspaces, tmp_path, family, extra):
    rows = [r for r in ppo(moe_workspaces[family], tmp_path / "run", *extra) if "actor/pg_loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert 0.9 < row["actor/moe/load_balancing_loss"] < 2.0
        # Every routing the update was asked to replay (R2: the old pass's, R3: the engine's) is
        # what its forwards ran (a replay not reaching the routers would run their own choice).
        assert row["actor/moe/replay_ran"] == 1.0
        if "rollout.dtype=bfloat16" not in extra:
            # After each in-loop sync the engine scores its samples as the EP=2 actor does, and
            # (float32 both) routes every token as the trainer would: routing replay (R2) runs
            # end to end through the engine, the batch and the update.
            assert row["rollout/logprob_diff_max"] < 1e-4
            assert row["moe/routing_agreement"] == 1.0
            continue
        # The bf16 engine: the trainer's old pass ran the engine's experts on every token (off,
        # or not reaching the routers, the experts run would be the routers' own).
        assert row["moe/replayed_agreement"] == 1.0
        assert 1e-4 < row["rollout/logprob_diff_max"] < 0.5
    if "rollout.dtype=bfloat16" in extra:
        # ... where the routers' own choice differed from the engine's on some tokens (measured,
        # not assumed: the two agreements would be equal without replay).
        agreement = [r["moe/routing_agreement"] for r in rows]
        assert 0.5 < min(agreement) < 1.0, agreement
    # In the update, the routers' own choice differed from the replayed one on some tokens (the
    # weights move between the recording pass and later mini-batches; the bf16 engine's differ).
    assert min(r["actor/moe/replay_own"] for r in rows) < 1.0
