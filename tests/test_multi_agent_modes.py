"""Several actors in one run, the other play modes end to end: proposer-solver and
critique-revise training both agents (reward models and a pool of their own), two agents side by
side with dynamic sampling, an answerer with a critic of its own that learns, and an agent at
PP=2 blowing up and every agent rolling back (test_multi_agent.py: population mode)."""

import json
import math

import pytest

from tests.test_multi_agent import build_workspace, overrides, ppo, rows

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return build_workspace(tmp_path_factory.mktemp("agents"))


GAE_STEPS, GAE_VF_FACTOR, GAE_GAIN = 8, 0.5, 0.0  # bars set below the worst of the measured spread
GAE_OVERRIDES = lambda ws: (  # noqa: E731
    "multi_agent.mode=critique-revise", "multi_agent.answerer=a", "algorithm.adv_estimator=gae",
    "actor.policy_loss=vanilla", "actor.loss_agg_mode=token-mean", f"reward.model_path={ws / 'rm'}",
    "reward.fn=null", "reward.oracle_fn=addition", "critic.optim.lr=1e-3", "critic.optim.min_lr=1e-3")
GAE_RUN = (f"trainer.max_steps={GAE_STEPS}", "trainer.val_before_train=false",
           "trainer.save_every_steps=0", "actor.ppo_mini_batch_size=8",
           "actor.ppo_micro_batch_size_per_rank=8", "actor.ppo_epochs=2")


@pytest.mark.parametrize("mode,extra", [
    ("proposer-solver", ["multi_agent.proposer=a"]),
    # Each agent its own reward model: the answerer the shared one, the critic the negated one.
    # ... and a resource pool of its own.
    ("critique-revise", ["multi_agent.answerer=a", "reward.model_path={ws}/rm",
                         "agents.1.reward_model_path={ws}/rm_negated", "agents.1.resource_pool=separate"]),
])
def test_two_player_modes_train_both_agents(workspace, tmp_path, mode, extra):
    out = tmp_path / mode
    extra = [e.format(ws=workspace) for e in extra]
    done = ppo(overrides(workspace, out, f"multi_agent.mode={mode}", "algorithm.adv_estimator=grpo",
                         "actor.policy_loss=vanilla", "actor.loss_agg_mode=token-mean",
                         "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_rank=4",
                         "trainer.max_steps=2", "trainer.val_before_train=true", *extra))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [r for r in rows(out) if r["step"] > 0 and "agent/a/actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    validated = "b" if mode == "proposer-solver" else "a"
    assert "agent/" + validated + "/val/oracle_acc" in rows(out)[0]
    if mode == "proposer-solver":
        # The solver trains on exactly the steps whose proposals held a valid task (a random
        # proposer writes one now and then: step 1 here).
        every = [r for r in rows(out) if "proposer/valid_fraction" in r]
        assert [r["step"] for r in every] == [1, 2]
        assert [("agent/b/actor/pg_loss" in r) for r in every] == [
            r["proposer/valid_fraction"] > 0 for r in every]
    else:
        assert all("agent/b/actor/pg_loss" in r and "critique/final_answer_acc" in r for r in steps)
        # Two judge groups, each scoring the same final answers for its own agent.
        assert "judge 0: reward model" in done.stdout and "judge 1: reward model" in done.stdout
        assert "on pool agent-b (1 agent(s)" in done.stdout and "on pool shared (1 agent(s)" in done.stdout
        for r in steps:
            assert r["agent/a/reward/rm_mean"] != 0.0
            assert r["agent/b/reward/rm_mean"] == pytest.approx(-r["agent/a/reward/rm_mean"], rel=1e-5)


def test_two_agents_side_by_side_each_sample_dynamically(workspace, tmp_path):
    """``multi_agent.mode=solo`` with two agents: each rolls out on its own, with DAPO's dynamic
    sampling (rounds of generation until its batch holds groups with signal), and trains on
    its own batch; each agent's checkpoints in its own folder."""
    out = tmp_path / "dapo"
    done = ppo(overrides(workspace, out, "multi_agent.mode=solo", "algorithm.adv_estimator=grpo",
                         "actor.policy_loss=vanilla", "actor.loss_agg_mode=token-mean",
                         "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=oracle",
                         "algorithm.filter_groups.max_rounds=3", "rollout.temperature=1.0",
                         "trainer.max_steps=2", "trainer.val_before_train=false"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [r for r in rows(out) if "agent/a/actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        for name in ("a", "b"):
            key = f"agent/{name}/dapo/"
            assert 1 <= r[key + "rounds"] <= 3 and r[key + "trained_groups"] <= 4
            assert r[key + "kept_groups"] + r[key + "dropped_groups"] >= 4
            assert math.isfinite(r[f"agent/{name}/actor/pg_loss"])
    raw = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("timing/gen/a" in r and "timing/gen/b" in r for r in raw if "agent/a/actor/pg_loss" in r)
    for name in ("a", "b"):
        assert (out / "agents" / name / "checkpoints" / "actor" / "step_00000002").is_dir()


def test_an_answerer_with_a_critic_of_its_own_learns_in_critique_revise(workspace, tmp_path):
    """GAE in a two-player mode: each agent trains a critic of its own (in its own group, beside
    its reward model) on the tokens it wrote; the answerer's critic loss falls and the reward
    its final answers earn rises. Each reward model steps aside while its group generates
    (``reward.offload``, riding this run: its weights must come back for the scores to rise)."""
    out = tmp_path / "gae"
    done = ppo(overrides(workspace, out, *GAE_OVERRIDES(workspace), *GAE_RUN,
                         "reward.offload.params=true"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "judge" not in done.stdout  # each agent hosts its reward model beside its critic
    steps = [r for r in rows(out) if "agent/a/critic/vf_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, GAE_STEPS + 1))
    assert all("agent/b/critic/vf_loss" in r for r in steps)
    for name in ("a", "b"):  # the reward model alone is offloaded: its weights moved every step
        assert all(r[f"agent/{name}/offload/bytes"] > 0 for r in steps), name
        assert all(r[f"agent/{name}/offload/resident_bytes_generating"] == 0 for r in steps), name
    half = GAE_STEPS // 2
    first, last = steps[:half], steps[-half:]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    assert mean(last, "agent/a/critic/vf_loss") < GAE_VF_FACTOR * mean(first, "agent/a/critic/vf_loss")
    assert mean(last, "agent/a/reward/score_mean") > mean(first, "agent/a/reward/score_mean") + GAE_GAIN
    for name in ("a", "b"):
        for role in ("actor", "critic"):
            assert (out / "agents" / name / "checkpoints" / role / f"step_{GAE_STEPS:08d}").is_dir()


def test_an_agent_at_pp2_blows_up_and_every_agent_rolls_back(workspace, tmp_path):
    """SPPO over two pipeline stages (agent b, PP=2) next to agent a (one rank) whose reference
    is another policy: a's KL to it is large from the first step, b's (its own start) is not.
    Then b's learning rate of 1e30 blows its weights up at step 2: every agent goes back to
    step 1 with the lowered rate, and the run finishes with finite losses."""
    out = tmp_path / "rb"
    common = ("agents.1.world_size=2", "agents.1.parallel.pp=2",
              f"agents.0.reference_path={workspace / 'other'}", "actor.use_kl_loss=true",
              "actor.kl_loss_coef=0.01", "actor.ppo_mini_batch_size=8",
              "actor.ppo_micro_batch_size_per_rank=8", "trainer.save_every_steps=1",
              "trainer.val_before_train=false")
    done = ppo(overrides(workspace, out, *common, "trainer.max_steps=1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    first = rows(out)[0]
    assert first["agent/a/actor/kl"] > 10 * first["agent/b/actor/kl"]
    blowup = ("agents.1.optim.lr=1e30", "agents.1.optim.min_lr=1e30",
              "trainer.rollback.lr_factor=1e-33", "trainer.rollback.max_rollbacks=1",
              "trainer.max_steps=3")
    done = ppo(overrides(workspace, out, *common, *blowup))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "rollback 1/1 at step 2: agent b" in done.stdout
    assert "every agent restored to step 1" in done.stdout
    trained = [r for r in rows(out) if "agent/b/actor/pg_loss" in r]
    assert [r["step"] for r in trained] == [1, 2, 3]
    for r in trained:
        for key in ("agent/a/actor/pg_loss", "agent/b/actor/pg_loss", "agent/b/actor/grad_norm"):
            assert math.isfinite(r[key]), (r["step"], key)
    assert trained[-1]["agent/b/actor/lr"] == pytest.approx(1e-3)
