"""Several actors in one run, on real worker groups: the preference table every rank of every
agent trains on (agents at different data-parallel sizes), an update of one agent leaving the
other bitwise untouched, joint checkpoints and exact resume after a kill between two agents'
saves, per-agent TensorBoard scalars and the win-rate matrix. The other play modes and the
rollback of every agent: test_multi_agent_modes.py."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
VOLATILE = ("timing/", "throughput/", "busy/")  


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return build_workspace(tmp_path_factory.mktemp("agents"))


def build_workspace(root: Path) -> Path:
    """Task data, a tiny base policy, a random reward model on its vocabulary, the same reward
    model negated, and a perturbed copy of the base."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from megatron_rlhf.models.tiny import tiny_config
    from tests.tiny_models import build_task_workspace

    ws = build_task_workspace(root, train=128, val=8, seed=0)
    # A random Bradley-Terry head on the same vocabulary: the shared judge.
    tokenizer = AutoTokenizer.from_pretrained(ws / "base")
    config = tiny_config("qwen2", "value", vocab_size=len(tokenizer), num_layers=2,
                         pad_token_id=tokenizer.pad_token_id)
    rm = AutoModelForSequenceClassification.from_config(config)
    rm.save_pretrained(ws / "rm")
    tokenizer.save_pretrained(ws / "rm")
    # The same judge with its head negated: an agent's reward model of its own, whose every
    # score is minus the shared one's.
    import torch

    with torch.no_grad():
        rm.score.weight.neg_()
    rm.save_pretrained(ws / "rm_negated")
    tokenizer.save_pretrained(ws / "rm_negated")
    # Another policy on the same vocabulary (the base, perturbed): a reference of one's own.
    import torch
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(ws / "base")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    other.save_pretrained(ws / "other")
    tokenizer.save_pretrained(ws / "other")
    return ws


def overrides(ws: Path, out: Path, *extra: str) -> list[str]:
    data, base = ws / "data", ws / "base"
    return [f"agents=[{{name: a, model_path: {base}}}, {{name: b, model_path: {base}, "
            f"optim: {{lr: 5.0e-4, min_lr: 5.0e-4}}}}]",
            f"data.train_files=[{data / 'prompts_train.parquet'}]",
            f"data.val_files=[{data / 'prompts_val.parquet'}]", "data.max_prompt_length=32",
            "data.max_response_length=8", "data.train_batch_size=4", "rollout.n=4",
            "actor.ppo_mini_batch_size=16", "actor.ppo_micro_batch_size_per_rank=8",
            "actor.ppo_epochs=1", "actor.optim.lr=1e-3", "actor.optim.min_lr=1e-3",
            "algorithm.adv_estimator=sppo", "actor.policy_loss=sppo", "actor.sppo_eta=2.0",
            "actor.loss_agg_mode=seq-mean-token-mean", "algorithm.use_kl_in_reward=false",
            "reward.fn=addition", "trainer.logger=tensorboard", f"trainer.output_dir={out}",
            "trainer.eval_every_steps=0", "multi_agent.mode=population", *extra]


def ppo(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_rlhf.cli", "ppo", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def rows(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(VOLATILE)} for line in lines]


def test_one_table_for_every_rank_and_an_update_touches_only_its_agent(workspace, tmp_path):
    """Agent a on one rank, agent b on two (DP=2), sharing one pool of two devices, a reward
    model judging both: every rank of both agents derives its targets from the driver's one
    table (same digest), and a's update leaves b's weights bitwise equal."""
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_schema import PPOConfig
    from megatron_rlhf.trainers.rl.fit import start
    from megatron_rlhf.trainers.rl.placement import setup, shutdown
    from megatron_rlhf.orchestration.cluster import stop_ray
    from megatron_rlhf.trainers.rl.agent import Timer
    from megatron_rlhf.trainers.rl.worker import PPOWorker

    cfg = load_config(PPOConfig, None, overrides(
        workspace, tmp_path / "run", "agents.1.world_size=2",
        f"reward.model_path={workspace / 'rm'}", "reward.fn=null", "reward.oracle_fn=addition",
        "trainer.val_before_train=false"))
    run = setup(cfg)
    try:
        start(run)
        a, b = run.agents["a"].actor, run.agents["b"].actor
        assert b.world_size == 2 and len(run.judges) == 1
        before_a, before_b = a.call(PPOWorker.weights_digest), b.call(PPOWorker.weights_digest)
        episodes, metrics = run.mode.play(run, 0, Timer())
        table = episodes["a"].population["preferences"]
        assert episodes["a"].scored["rm"] is not None  # the judge scored them
        expected = hashlib.sha256(table.contiguous().numpy().tobytes()).hexdigest()
        seen_a = run.update("a", episodes["a"], Timer()).digests
        assert a.call(PPOWorker.weights_digest) != before_a
        assert b.call(PPOWorker.weights_digest) == before_b  # bitwise: a's step never reached b
        seen_b = run.update("b", episodes["b"], Timer()).digests
        assert seen_a == [expected] and seen_b == [expected, expected]
        assert abs(metrics["population/win_rate/a/b"] + metrics["population/win_rate/b/a"] - 1) < 1e-6
    finally:
        shutdown(run)
        stop_ray(run.ray_started)


POPULATION = ("trainer.max_steps=2", "trainer.save_every_steps=1", "trainer.keep_last_n=2",
              "trainer.val_before_train=false")


@pytest.fixture(scope="module")
def population(workspace, tmp_path_factory):
    """A 2-step population run: (its folder, its metrics rows and TensorBoard points as it
    finished; a test below changes the folder)."""
    from tests.interrupt import scalars, steady

    out = tmp_path_factory.mktemp("population") / "pop"
    done = ppo(overrides(workspace, out, *POPULATION))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, steady(out), scalars(out)


def test_population_run_logs_per_agent_and_resumes_after_a_kill_between_saves(workspace, population, tmp_path):
    out = population[0]
    args = overrides(workspace, out, *POPULATION)
    full = [r for r in rows(out) if "agent/a/actor/pg_loss" in r]
    assert [r["step"] for r in full] == [1, 2]
    for r in full:
        assert r["population/table_ranks_agreeing"] == 2.0
        assert abs(r["population/win_rate/a/b"] + r["population/win_rate/b/a"] - 1) < 1e-6
    assert full[0]["agent/b/actor/lr"] == 5e-4 and full[0]["agent/a/actor/lr"] == 1e-3

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"agent/a/actor/pg_loss", "agent/b/actor/pg_loss", "agent/a/reward/score_mean",
            "agent/b/population/win_rate", "population/win_rate/a/b",
            "population/win_rate/b/a"} <= tags
    # A kill after a saved step 2 and before b did: step 1 is the newest both have.
    ckpt = lambda name, step: out / "agents" / name / "checkpoints" / "actor" / f"step_{step:08d}"  # noqa: E731
    import shutil

    shutil.rmtree(ckpt("b", 2))
    again = ppo(args)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resumed every agent from step 1" in again.stdout
    redone = [r for r in rows(out) if "agent/a/actor/pg_loss" in r]
    assert [r["step"] for r in redone] == [1, 2]
    for key in ("agent/a/actor/pg_loss", "agent/b/actor/pg_loss", "agent/a/reward/score_mean",
                "population/win_rate/a/b"):
        assert abs(redone[1][key] - full[1][key]) < 1e-6 * max(1.0, abs(full[1][key])), key
    assert ckpt("a", 2).is_dir() and ckpt("b", 2).is_dir()
    # Each agent's checkpoint is an ordinary policy checkpoint: ab-test compares it with its start.
    ab = subprocess.run(
        [sys.executable, "-m", "megatron_rlhf.cli", "ab-test", "--policy-a", str(ckpt("b", 2)),
         "--policy-b", str(workspace / "base"), "--prompts",
         str(workspace / "data" / "prompts_val.parquet"), "--judge", "fn:addition",
         "--samples-per-prompt", "2", "--max-new-tokens", "8", "--num-resamples", "200",
         "--out", str(tmp_path / "ab")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert ab.returncode == 0, ab.stdout[-3000:] + ab.stderr[-3000:]
    summary = json.loads((tmp_path / "ab" / "summary.json").read_text())
    assert summary["num_prompts"] == 8 and summary["samples_per_prompt"] == 2
    assert summary["win_rate"]["low"] <= summary["win_rate"]["estimate"] <= summary["win_rate"]["high"]


def test_a_causal_lm_as_an_agents_reward_model_is_one_line(workspace, tmp_path):
    out = tmp_path / "bad"
    done = ppo(overrides(workspace, out, "multi_agent.mode=critique-revise",
                         "algorithm.adv_estimator=grpo", "actor.policy_loss=vanilla",
                         f"agents.1.reward_model_path={workspace / 'base'}"))
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: the reward model of agent(s) b: {workspace / 'base'} is a causal LM, not a reward "
        "model (train one with `megatron-rlhf train-rm`)")
    assert not (out / "agents").exists() and not (out / "metrics.jsonl").exists()


def test_a_population_run_killed_during_an_agents_save_resumes_exactly(workspace, population, tmp_path):
    """SIGKILL of the whole tree while an agent's checkpoint is half-written: the relaunch
    resumes every agent from the newest step all of them committed, and ends with every logged
    value equal to an uninterrupted run's (bitwise), no row missing or doubled."""
    from tests.interrupt import kill_tree, launch, leftovers, saving, scalars, steady, wait_until

    out, log = tmp_path / "run", tmp_path / "run.log"
    args = ["ppo", *overrides(workspace, out, *POPULATION)]
    proc = launch(args, log)
    second = lambda: any((out / "agents" / n / "checkpoints" / "actor" / "step_00000002.partial").is_dir()  # noqa: E731
                         for n in ("a", "b"))
    assert wait_until(proc, second), log.read_text()[-3000:]
    assert saving(out)
    kill_tree(proc)
    proc = launch(args, log)
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    assert "resumed every agent from step 1" in log.read_text()
    assert steady(out) == population[1]
    assert scalars(out) == population[2]
    assert leftovers(out) == []
