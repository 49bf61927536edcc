"""PPO's guard and layouts end to end: rollback on a KL spike and on a NaN loss (the lowered lr
taking effect and surviving a resume), and TP/PP/engine placements equal to one rank, all
from one greedy 2-step run at TP=1 (the layouts' reference, the guards' restore points)."""

import math

import pytest

from tests.ppo_helpers import GREEDY, build_workspace, continued, finish, metrics, overrides, ppo

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return build_workspace(tmp_path_factory)


# Two greedy steps at TP=1, saved after each: the reference of the layout test and the restore
# points the two guard tests start from (each on its own copy), one run for the three.
@pytest.fixture(scope="module")
def greedy_two_steps(workspace, tmp_path_factory):
    out = tmp_path_factory.mktemp("ppo_greedy") / "run"
    code, stdout, stderr = finish(ppo(overrides(workspace, out, "trainer.max_steps=2",
                                                "trainer.save_every_steps=1", *GREEDY)))
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    return out


def test_rollback_on_kl_spike_restores_and_stops(workspace, greedy_two_steps, tmp_path):
    # With no checkpoint yet the guard has nowhere to go: the run stops with one line, nothing saved.
    fresh = tmp_path / "fresh"
    code, stdout, stderr = finish(ppo(overrides(workspace, fresh, "trainer.max_steps=2",
                                                "trainer.rollback.kl_threshold=1e-12")))
    assert code == 2 and "no checkpoint to roll back to" in stderr
    assert not list(fresh.glob("checkpoints/*/step_*"))
    out = continued(greedy_two_steps, tmp_path / "run")
    # Any update now "spikes": the threshold is below every KL an update can produce.
    spiky = overrides(workspace, out, *GREEDY, "trainer.max_steps=5", "trainer.save_every_steps=1",
                      "trainer.rollback.kl_threshold=1e-12", "trainer.rollback.max_rollbacks=2",
                      "trainer.rollback.lr_factor=0.5", "trainer.rollback.kl_coef_factor=2.0",
                      "actor.use_kl_loss=true", "actor.kl_loss_coef=0.01")
    code, stdout, stderr = finish(ppo(spiky))
    assert code == 2, stdout[-3000:] + stderr[-3000:]
    assert "rollback 1/2 at step 3" in stdout and "restored step 2, lr scale now 0.5" in stdout
    # Step 3 failing again from step 2 goes one restore point further back, dropping step 2.
    assert "rollback 2/2 at step 3" in stdout and "lr scale now 0.25" in stdout
    assert "restored step 1" in stdout and "stepped back past step(s) 2, deleted" in stdout
    assert "kl_loss_coef now 0.02" in stdout and "kl_loss_coef now 0.04" in stdout
    assert "step 2: actor/kl" in stderr and "already rolled back 2 times" in stderr
    # Nothing after the restored step was kept: checkpoints and logs end at step 1.
    assert sorted(p.name for p in (out / "checkpoints" / "actor").iterdir())[-1] == "step_00000001"
    assert max(r["step"] for r in metrics(out)) == 1


def test_nan_loss_rolls_back_and_the_lowered_lr_takes_effect(workspace, greedy_two_steps, tmp_path):
    out = continued(greedy_two_steps, tmp_path / "run")
    greedy = (*GREEDY, "trainer.save_every_steps=2")
    # lr 1e30 blows the weights up in step 3's first optimizer step, and its next mini-batch's
    # loss is NaN. The guard restores step 2 with the lr scaled to 1e-3, which must then apply.
    blowup = (*greedy, "actor.optim.lr=1e30", "actor.optim.min_lr=1e30",
              "actor.optim.warmup_steps_ratio=0", "trainer.rollback.lr_factor=1e-33",
              "trainer.rollback.max_rollbacks=1", "trainer.rollback.kl_coef_factor=3.0",
              "actor.use_kl_loss=true", "actor.kl_loss_coef=0.01")
    code, stdout, stderr = finish(ppo(overrides(workspace, out, "trainer.max_steps=4", *blowup)))
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    assert "rollback 1/1 at step 3" in stdout and "restored step 2, lr scale now 1e-33" in stdout
    assert "is nan" in stdout.lower() or "is inf" in stdout.lower()
    rows = [r for r in metrics(out) if "actor/pg_loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["actor/pg_loss"]) and math.isfinite(r["actor/grad_norm"]) for r in rows)
    assert rows[-1]["actor/lr"] == pytest.approx(1e-3)
    assert rows[-1]["actor/kl_loss_coef"] == pytest.approx(0.03)
    # A resumed run keeps what the rollback changed: the lowered lr and the raised KL-loss weight
    # (a fresh lr of 1e30 would blow the weights up again, and with no rollback left, stop).
    code, stdout, stderr = finish(ppo(overrides(workspace, out, "trainer.max_steps=5", *blowup)))
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    assert "resumed from step 4" in stdout
    last = [r for r in metrics(out) if "actor/pg_loss" in r][-1]
    assert last["step"] == 5 and math.isfinite(last["actor/pg_loss"])
    assert last["actor/lr"] == pytest.approx(1e-3) and last["actor/kl_loss_coef"] == pytest.approx(0.03)


def test_engine_layouts_and_placements_match_tp1_with_greedy_rollouts(workspace, greedy_two_steps, tmp_path):
    """PP=2 feeding one rollout engine split over both ranks (rollout.tp=2, laid out by the
    engine placement); TP=2 and PP=2 feeding an engine on a rank of its own over the weight
    bridge; and the engine's log-probs taken as the old ones (bypass): each the same run as one
    rank."""
    layouts = {"pp2_engine_tp2": ("actor.parallel.pp=2", "trainer.n_gpus_per_node=2",
                                  "rollout.tp=2"),
               # engines on a rank of their own, fed over the weight bridge
               "tp2_separate": ("actor.parallel.tp=2", "trainer.n_gpus_per_node=2",
                                "rollout.placement=separate", "rollout.world_size=1"),
               "pp2_separate": ("actor.parallel.pp=2", "trainer.n_gpus_per_node=2",
                                "rollout.placement=separate", "rollout.world_size=1"),
               # the engine's log-probs as the old ones (engine == trainer here): no old pass
               "tp1_bypass": ("algorithm.rollout_correction.bypass=true",)}
    runs = {"tp1": [r for r in metrics(greedy_two_steps) if "actor/pg_loss" in r]}
    for name, layout in layouts.items():
        out = tmp_path / name
        args = overrides(workspace, out, "trainer.max_steps=2", *GREEDY, *layout)
        code, stdout, stderr = finish(ppo(args))
        assert code == 0, stdout[-3000:] + stderr[-3000:]
        runs[name] = [r for r in metrics(out) if "actor/pg_loss" in r]
    for other in layouts:
        assert len(runs[other]) == len(runs["tp1"]) == 2
        for a, b in zip(runs["tp1"], runs[other]):
            for key in ("actor/pg_loss", "actor/kl", "critic/vf_loss", "reward/score_mean",
                        "actor/entropy"):
                assert abs(a[key] - b[key]) < 1e-4, (other, key, a[key], b[key])
    # Only a run with a trainer pass for the old log-probs can compare them with the engine's.
    assert all("rollout/logprob_diff_max" not in r for r in runs["tp1_bypass"])
    assert all(r["rollout/logprob_diff_max"] < 1e-5 for r in runs["tp1"])
