"""PPO end to end through the real command: Ray driver, worker groups, HF rollouts, Megatron
updates. Exact resume after kill -9, rollback on a KL spike, layout parity, fail-fast."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

VOLATILE = ("timing/", "throughput/", "busy/")  


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from tests.tiny_models import build_task_workspace

    return build_task_workspace(tmp_path_factory.mktemp("ppo"), train=256, val=16, seed=0)


def overrides(ws: Path, out: Path, *extra: str) -> list[str]:
    data = ws / "data"
    return [f"actor.model_path={ws / 'base'}", f"data.train_files=[{data / 'prompts_train.parquet'}]",
            f"data.val_files=[{data / 'prompts_val.parquet'}]", "data.max_prompt_length=32",
            "data.max_response_length=8", "data.train_batch_size=16", "actor.ppo_mini_batch_size=8",
            "actor.ppo_micro_batch_size_per_rank=4", "actor.ppo_epochs=2", "actor.optim.lr=1e-3",
            "actor.optim.min_lr=1e-3", "reward.fn=addition", "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.05",
            "trainer.logger=tensorboard", f"trainer.output_dir={out}", "trainer.eval_every_steps=3",
            *extra]


def ppo(args: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megatron_rlhf.cli", "ppo", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)


def finish(proc: subprocess.Popen, timeout: int = 600) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in rows]


# Sampling at a temperature other than 1 checks that engine and actor score the same (tempered)
# distribution.
FULL_RUN = ("trainer.max_steps=6", "trainer.save_every_steps=2", "rollout.temperature=0.7",
            "actor.use_kl_loss=true", "actor.kl_loss_coef=0.02")


@pytest.fixture(scope="module")
def uninterrupted(workspace, tmp_path_factory):
    out = tmp_path_factory.mktemp("ppo_full")
    code, stdout, stderr = finish(ppo(overrides(workspace, out, *FULL_RUN)))
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    return out, stdout


# Two greedy steps at TP=1, saved after each: the reference of the layout test and the restore
# points the two guard tests start from (each on its own copy), one run for the three.
GREEDY = ("rollout.temperature=0", "trainer.eval_every_steps=0", "trainer.val_before_train=false")


@pytest.fixture(scope="module")
def greedy_two_steps(workspace, tmp_path_factory):
    out = tmp_path_factory.mktemp("ppo_greedy") / "run"
    code, stdout, stderr = finish(ppo(overrides(workspace, out, "trainer.max_steps=2",
                                                "trainer.save_every_steps=1", *GREEDY)))
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    return out


def continued(prefix: Path, out: Path) -> Path:
    """A copy of a finished run's folder, to go on from its checkpoints."""
    import shutil

    shutil.copytree(prefix, out)
    return out


def test_ppo_runs_and_logs_the_named_metrics(uninterrupted):
    out, stdout = uninterrupted
    rows = metrics(out)
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2, 3, 4, 5, 6]
    step = next(r for r in rows if r["step"] == 6 and "actor/pg_loss" in r)
    for key in ("reward/score_mean", "reward/score_median", "reward/oracle_mean", "actor/kl",
                "actor/entropy", "actor/clipfrac", "actor/pg_loss", "critic/vf_loss",
                "critic/vf_explained_var", "response/length_mean", "timing/gen",
                "timing/update_actor", "timing/sync", "throughput/tokens_per_s"):
        assert key in json.loads((out / "metrics.jsonl").read_text().splitlines()[-2]) or key in step, key
    # The KL loss weighs by its own coefficient; the adaptive controller steers the in-reward one.
    updates = [r for r in rows if "actor/pg_loss" in r]
    assert all(r["actor/kl_loss_coef"] == 0.02 for r in updates)
    assert updates[0]["actor/kl_coef"] == 0.05 and updates[-1]["actor/kl_coef"] < 0.05
    # The engine's own log-probs equal the actor's after every in-loop weight sync.
    assert max(r["rollout/logprob_diff_max"] for r in rows if "actor/pg_loss" in r) < 1e-4
    assert any("val/oracle_acc" in r for r in rows)
    assert list((out / "tensorboard").glob("events.*"))
    assert sorted(p.name for p in (out / "checkpoints" / "actor").iterdir()) == ["step_00000004",
                                                                                 "step_00000006"]


def checkpoint_tensors(step_dir: Path) -> dict:
    """Every tensor of a checkpoint's model folder, read without a process group."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(step_dir / "model"), f"{tmp}/all.pt")
        state = torch.load(f"{tmp}/all.pt", weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


# Every offload switch: the colocated actor, reference and critic step aside (trainers/offload.py).
OFFLOAD_ALL = tuple(f"{model}.{part}=true" for model in ("actor.offload", "critic.offload")
                    for part in ("params", "grads", "optimizer")) + ("actor.ref_offload.params=true",)


def test_one_agent_as_a_list_with_offload_is_the_plain_run(workspace, uninterrupted, tmp_path):
    """``agents:`` of one agent with no ``multi_agent.mode`` is the plain run through the same
    loop, and offloading the colocated actor, reference and critic between phases changes
    nothing either (one run checks both, to spare the suite a run): every metrics row with the
    same names (``offload/*`` aside) and (timings aside) values, and the same checkpoints,
    actor and critic, tensor for tensor, bitwise."""
    import torch

    reference = uninterrupted[0]
    out = tmp_path / "listed"
    listed = f"agents=[{{name: solo, model_path: {workspace / 'base'}, world_size: 1}}]"
    code, stdout, stderr = finish(ppo(overrides(workspace, out, *FULL_RUN, listed, *OFFLOAD_ALL)))
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in rows if "actor/pg_loss" in r]
    # Bytes moved every step; the seconds are logged (their size is the benchmark's business).
    assert len(updates) == 6 and all(r["offload/bytes"] > 0 and {"offload/seconds_out",
                                     "offload/seconds_in"} <= set(r) for r in updates)
    # Measured from the storages when each generation started: the trainer had stepped aside.
    assert all(r["offload/resident_bytes_generating"] == 0 for r in updates)
    names = [sorted(k for k in row if not k.startswith("offload/")) for row in rows]
    assert names == [sorted(json.loads(line)) for line in
                     (reference / "metrics.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in r.items() if not k.startswith("offload/")}
            for r in metrics(out)] == metrics(reference)
    assert not (out / "agents").exists()
    for role in ("actor", "critic"):
        steps = sorted(p.name for p in (reference / "checkpoints" / role).iterdir())
        assert sorted(p.name for p in (out / "checkpoints" / role).iterdir()) == steps
        for step in steps:
            ours = checkpoint_tensors(out / "checkpoints" / role / step)
            theirs = checkpoint_tensors(reference / "checkpoints" / role / step)
            assert ours.keys() == theirs.keys() and len(ours) > 10
            assert all(torch.equal(ours[k], theirs[k]) for k in ours), (role, step)


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


def test_bad_config_is_one_clear_line(workspace, tmp_path):
    code, stdout, stderr = finish(ppo(overrides(workspace, tmp_path / "run", "algorithm.adv_estimator=grpo")))
    assert code == 2
    assert stderr.strip().splitlines()[-1].startswith("error: config: algorithm.adv_estimator=grpo")


def test_on_policy_grpo_skips_old_and_reference_passes_without_changing_the_update(workspace, tmp_path):
    """One epoch over one mini-batch: old log-probs come from the update's own forward and no
    reference model is loaded. Forcing both passes back (a zero-weight in-reward KL needs them)
    must give the same update."""
    grpo = ["algorithm.adv_estimator=grpo", "rollout.n=4", "actor.ppo_epochs=1",
            "actor.ppo_mini_batch_size=64", "actor.ppo_micro_batch_size_per_rank=16",
            "algorithm.kl_ctrl.type=fixed", "algorithm.kl_ctrl.kl_coef=0", "trainer.max_steps=2",
            "trainer.eval_every_steps=0", "trainer.val_before_train=false"]
    runs = {}
    for label, kl in (("on_policy", "false"), ("recomputed", "true")):
        out = tmp_path / label
        code, stdout, stderr = finish(ppo(overrides(workspace, out, *grpo,
                                                    f"algorithm.use_kl_in_reward={kl}")))
        assert code == 0, stdout[-3000:] + stderr[-3000:]
        runs[label] = [r for r in metrics(out) if "actor/pg_loss" in r]
    fast, slow = runs["on_policy"], runs["recomputed"]
    assert all("actor/kl" not in r and "rollout/logprob_diff_max" not in r for r in fast)
    assert all("actor/kl" in r and r["rollout/logprob_diff_max"] < 1e-4 for r in slow)
    for a, b in zip(fast, slow):
        assert a["actor/ppo_kl"] == 0.0 and a["actor/clipfrac"] == 0.0  # ratio exactly 1
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "reward/score_mean"):
            assert abs(a[key] - b[key]) < 1e-4 * max(1.0, abs(b[key])), (key, a[key], b[key])


def test_feedback_tokens_continue_the_chat_template(workspace):
    from transformers import AutoTokenizer

    from megatron_rlhf.rollout.multi_turn import feedback_tokens

    tok = AutoTokenizer.from_pretrained(workspace / "base")
    chat = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"},
            {"role": "user", "content": "Try again."}]
    prompt = tok.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
    answer = "5" + tok.decode([tok.eos_token_id])
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    whole = ids(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    assert ids(prompt) + ids(answer) + feedback_tokens(tok, "Try again.", tok.eos_token_id) == whole


def test_multi_turn_ppo_retries_and_trains(workspace, tmp_path):
    out = tmp_path / "run"
    # The tiny base is untrained and never says its end token: ending a turn at any digit
    # gives it finished, mostly wrong turns to retry.
    digits = ",".join(f'"{d}"' for d in range(10))
    args = overrides(workspace, out, "rollout.max_turns=3", f"rollout.stop=[{digits}]",
                     "rollout.n=4", "actor.ppo_mini_batch_size=32",
                     "actor.ppo_micro_batch_size_per_rank=16", "trainer.max_steps=2",
                     "trainer.eval_every_steps=0", "trainer.val_before_train=false")
    code, stdout, stderr = finish(ppo(args))
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    rows = [r for r in metrics(out) if "actor/pg_loss" in r]
    assert len(rows) == 2
    assert all(1.1 < r["response/turns_mean"] <= 3 for r in rows)
    assert all(math.isfinite(r["actor/pg_loss"]) and math.isfinite(r["critic/vf_loss"]) for r in rows)
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in rows)  # engine = actor on every turn


def test_hanging_and_raising_reward_functions_do_not_stop_a_run_with_its_own_critic_pool(workspace, tmp_path):
    """A fifth of the responses hang the reward function and a fifth make it raise: each is
    scored 0, counted and named, and the run finishes; its critic trains and saves on a pool of
    its own (one run for both, to spare the suite a run)."""
    out = tmp_path / "run"
    args = overrides(workspace, out, "reward.fn=tests.reward_helpers:flaky", "reward.workers=2",
                     "reward.timeout_s=1", "reward.oracle_fn=addition", "trainer.max_steps=2",
                     "resource_pool.critic=separate", "resource_pool.critic_world_size=1",
                     "trainer.eval_every_steps=0", "trainer.val_before_train=false")
    code, stdout, stderr = finish(ppo(args))
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    rows = [r for r in metrics(out) if "reward/errors" in r]
    assert len(rows) == 2
    assert sum(r["reward/timeouts"] for r in rows) > 0 and sum(r["reward/errors"] for r in rows) > 0
    assert "reward 'tests.reward_helpers:flaky' timed out (reward.timeout_s=1)" in stdout
    assert "reward 'tests.reward_helpers:flaky' raised RuntimeError" in stdout
    assert "+ 1 critic rank(s)" in stdout
    assert (out / "checkpoints" / "critic" / "step_00000002").is_dir()
    assert [r["step"] for r in metrics(out) if "critic/vf_loss" in r] == [1, 2]


def test_dapo_gspo_and_rollout_correction_run_end_to_end(workspace, tmp_path):
    """The recipes through the real command: dynamic sampling in rounds (with the overlong
    shaping and filter), GSPO's sequence loss, REINFORCE++-baseline, TIS + masking."""
    out = tmp_path / "run"
    args = overrides(workspace, out, "algorithm.adv_estimator=reinforce_plus_plus_baseline",
                     "rollout.n=4", "rollout.temperature=1.0", "data.train_batch_size=4",
                     "algorithm.use_kl_in_reward=false", "algorithm.filter_groups.enable=true",
                     "algorithm.filter_groups.metric=oracle", "algorithm.filter_groups.max_rounds=3",
                     "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=2",
                     "actor.overlong_filter=true", "actor.policy_loss=gspo",
                     "actor.loss_agg_mode=seq-mean-token-sum-norm",
                     "algorithm.rollout_correction.mode=tis+mask", "trainer.max_steps=2",
                     "trainer.eval_every_steps=0", "trainer.val_before_train=false")
    code, stdout, stderr = finish(ppo(args))
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    rows = [r for r in metrics(out) if "actor/pg_loss" in r]
    assert len(rows) == 2
    for r in rows:
        assert 1 <= r["dapo/rounds"] <= 3 and r["dapo/trained_groups"] <= 4
        assert r["dapo/kept_groups"] + r["dapo/dropped_groups"] >= 4
        assert r["reward/overlong_penalty_mean"] <= 0.0
        # The same weights in trainer and engine: no correction beyond float noise.
        assert r["rollout/logprob_diff_max"] < 1e-4 and abs(r["rollout/is_weight_mean"] - 1) < 1e-4
        assert r["rollout/masked_fraction"] == 0.0
        assert math.isfinite(r["actor/pg_loss"]) and math.isfinite(r["actor/grad_norm"])


def test_rollout_correction_acts_on_a_bf16_engine_fed_by_an_fp32_trainer(workspace, tmp_path):
    """A real train-inference mismatch end to end: the hf engine in bf16 (rollout.dtype), the
    trainer in fp32, the weight sync casting. The same step with and without the correction
    samples the same responses (same engine, same seeds) and updates differently: the engine's
    log-probs differ from the trainer's, TIS caps some tokens and the mask drops some samples;
    IcePop's band with token-level k3 rejection acts too, each logging what it did."""
    # GAE with a critic and KL in the reward (the tiny policy solves nothing yet, so outcome
    # baselines alone would give zero advantages). Bounds: bf16 vs fp32 token log-probs differ
    # by ~1e-3 here; TIS capped at 1 and a band of +-3e-4 around a sample's geometric mean ratio.
    base = ("rollout.n=2", "rollout.temperature=1.0", "data.train_batch_size=8",
            "actor.ppo_epochs=1", "rollout.dtype=bfloat16", "trainer.max_steps=1",
            "trainer.eval_every_steps=0", "trainer.val_before_train=false",
            "algorithm.rollout_correction.tis_cap=1.0",
            "algorithm.rollout_correction.mask_low=0.9997",
            "algorithm.rollout_correction.mask_high=1.0003")
    # The third: IcePop's band (weights outside [tis_low, tis_cap] zeroed) at the geometric level,
    # batch-normalised, with token-level k3 rejection.
    icepop = ("algorithm.rollout_correction.mode=tis+mask",
              "algorithm.rollout_correction.tis_level=geometric",
              "algorithm.rollout_correction.tis_low=0.9998",
              "algorithm.rollout_correction.tis_cap=1.0002",
              "algorithm.rollout_correction.tis_batch_normalize=true",
              "algorithm.rollout_correction.mask_level=token_k3",
              "algorithm.rollout_correction.mask_divergence_max=2e-7")
    runs = {}
    for name, extra in (("none", ("algorithm.rollout_correction.mode=none",)),
                        ("tis+mask", ("algorithm.rollout_correction.mode=tis+mask",)),
                        ("icepop", icepop)):
        out = tmp_path / name
        code, stdout, stderr = finish(ppo(overrides(workspace, out, *base, *extra)))
        assert code == 0, stdout[-3000:] + stderr[-3000:]
        runs[name] = [r for r in metrics(out) if "actor/pg_loss" in r][0]
    plain, corrected, band = runs["none"], runs["tis+mask"], runs["icepop"]
    # Same samples: the correction does not touch generation.
    for key in ("reward/score_mean", "response/length_mean", "rollout/logprob_diff_max"):
        assert plain[key] == corrected[key], key
    assert corrected["rollout/logprob_diff_max"] > 1e-4  # bf16 vs fp32, measured not assumed
    assert 0 < corrected["rollout/is_capped_fraction"] < 1
    assert corrected["rollout/masked_fraction"] > 0
    assert corrected["rollout/is_weight_mean"] < 1  # capped at 1: only weights below 1 remain
    assert plain["actor/grad_norm"] > 0
    assert corrected["actor/pg_loss"] != plain["actor/pg_loss"]
    assert corrected["actor/grad_norm"] != plain["actor/grad_norm"]
    # The band zeroes some sequences' weights, token k3 rejects some tokens, the rest averages 1.
    assert band["response/length_mean"] == plain["response/length_mean"]
    assert 0 < band["is/zeroed_fraction"] < 1 and 0 < band["rs/rejected_fraction"] < 1
    assert band["mismatch/kl_k1"] != 0 and band["mismatch/logprob_diff_mean"] > 0
    assert band["actor/grad_norm"] not in (plain["actor/grad_norm"], corrected["actor/grad_norm"])


def test_training_on_offline_responses_only(workspace, tmp_path):
    """data.offline_fraction=1: no rollouts. Each prompt comes with a right and a wrong answer
    (a group of two); the behaviour log-probs are not in the file, so the starting policy's are
    computed once, and the first step's importance weights are exactly 1."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(workspace / "data" / "prompts_train.parquet").to_pylist()
    rows = list({row["prompt"]: row for row in table}.values())[:64]  # distinct questions
    prompts, truths = [r["prompt"] for r in rows], [r["ground_truth"] for r in rows]
    offline = tmp_path / "offline.parquet"
    pq.write_table(pa.table({"prompt": prompts, "chosen": [f"The answer is {t}." for t in truths],
                             "rejected": [f"The answer is {int(t) + 1}." for t in truths],
                             "ground_truth": truths}), offline)
    out = tmp_path / "run"
    args = overrides(workspace, out, "algorithm.adv_estimator=grpo", "rollout.n=2",
                     f"data.offline_files=[{offline}]", "data.offline_fraction=1.0",
                     "algorithm.rollout_correction.mode=tis", "algorithm.use_kl_in_reward=false",
                     "data.max_response_length=12",
                     "trainer.max_steps=3", "trainer.eval_every_steps=0",
                     "trainer.val_before_train=false")
    code, stdout, stderr = finish(ppo(args))
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    assert "offline responses: 128 samples in 64 prompt groups" in stdout
    assert "behaviour log-probs of 128 responses computed by the starting policy" in stdout
    assert (out / "offline_logprobs.json").is_file()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "actor/pg_loss" in r]
    assert [r["offline/samples"] for r in rows] == [32.0, 32.0, 32.0]
    assert all("timing/gen" not in r for r in rows)  # nothing was generated
    assert abs(rows[0]["rollout/is_weight_mean"] - 1.0) < 1e-5  # behaviour = starting policy
    assert rows[0]["reward/score_mean"] == 0.5  # one right, one wrong answer per prompt
    assert abs(rows[-1]["rollout/is_weight_mean"] - 1.0) > 1e-4  # the policy has moved since


def test_sppo_runs_at_tp2_with_packing_and_resumes_exactly(workspace, tmp_path):
    """SPPO through the real command at TP=2 over packed micro-batches: a run SIGKILLed while it
    saves a later step (its metrics row already logged, its checkpoint not committed) and
    relaunched reproduces the uninterrupted run: every value of every step, exactly, no row
    missing or doubled."""
    from tests.interrupt import kill_tree, launch, rows, saving, steady, wait_until

    sppo = ["algorithm.adv_estimator=sppo", "actor.policy_loss=sppo", "actor.sppo_eta=2.0",
            "actor.loss_agg_mode=seq-mean-token-mean", "rollout.n=4", "data.train_batch_size=8",
            "algorithm.use_kl_in_reward=false", "actor.parallel.tp=2", "trainer.n_gpus_per_node=2",
            "data.use_remove_padding=true", "trainer.max_steps=3", "trainer.save_every_steps=1",
            "trainer.keep_last_n=3", "trainer.eval_every_steps=0", "trainer.val_before_train=false"]
    full = tmp_path / "full"
    code, stdout, stderr = finish(ppo(overrides(workspace, full, *sppo)))
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    reference = [r for r in metrics(full) if "actor/pg_loss" in r]
    assert len(reference) == 3 and all(math.isfinite(r["actor/pg_loss"]) for r in reference)
    assert reference[0]["actor/pg_loss"] > 0  # the squared gap to eta * (win rate - 1/2)

    out, log = tmp_path / "killed", tmp_path / "killed.log"
    args = ["ppo", *overrides(workspace, out, *sppo)]
    steps = lambda: [r for r in rows(out) if "actor/pg_loss" in r]  # noqa: E731
    committed = lambda: sorted(int(p.name[5:]) for p in (out / "checkpoints" / "actor").glob("step_*")  # noqa: E731
                               if p.name[5:].isdigit())
    proc = launch(args, log)
    # A save in flight of a step whose row is logged: the relaunch must drop that row.
    assert wait_until(proc, lambda: len(steps()) >= 2 and committed() and saving(out)), \
        log.read_text()[-3000:]
    kill_tree(proc)
    last = committed()[-1]
    assert len(steps()) > last, (len(steps()), last)
    proc = launch(args, log)
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    assert f"resumed from step {last}" in log.read_text()
    assert steady(out) == steady(full)
    assert [r["step"] for r in steps()] == [r["step"] for r in reference] == [1, 2, 3]


def test_kills_at_seeded_moments_and_a_stop_signal_end_as_the_uninterrupted_run(workspace, uninterrupted, tmp_path):
    """The whole process tree (driver, Ray, workers) SIGKILLed at start-up, during a save and
    mid-step, SIGUSR1 to the driver mid-step (again during the stop's save) and SIGTERM to one
    of its workers, each time relaunched with the same command: every logged value and
    TensorBoard point equals the uninterrupted run's, no row missing or doubled; a finished run
    relaunched does nothing."""
    import random

    import psutil

    from megatron_rlhf.errors import EXIT_STOPPED
    from tests.interrupt import (kill_tree, launch, leftovers, rows, saving, scalars, steady,
                                 wait_until)

    reference = uninterrupted[0]
    out, log = tmp_path / "run", tmp_path / "run.log"
    args = ["ppo", *overrides(workspace, out, *FULL_RUN)]
    moments = random.Random(26)

    def a_step_done(proc) -> bool:
        """This launch logged a step (metrics.jsonl still holds the killed launch's rows until
        the resume trims them, so its progress lines are counted instead)."""
        seen = log.read_text().count("/6 | ")
        return wait_until(proc, lambda: log.read_text().count("/6 | ") > seen)

    proc = launch(args, log)  # start-up: Ray and the workers coming up
    time.sleep(moments.uniform(2.0, 8.0))
    kill_tree(proc)
    proc = launch(args, log)  # SIGTERM to a worker itself, as srun signals every task
    assert a_step_done(proc)
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
               if "RankActor" in " ".join(p.cmdline())]
    assert workers
    workers[0].send_signal(signal.SIGTERM)
    assert proc.wait(timeout=600) == EXIT_STOPPED, log.read_text()[-3000:]
    assert "SIGTERM received by worker group actor" in log.read_text()
    proc = launch(args, log)  # a save
    assert wait_until(proc, lambda: saving(out)), log.read_text()[-3000:]
    kill_tree(proc)
    proc = launch(args, log)  # a stop signal mid-step, another during the stop's save
    assert a_step_done(proc)
    time.sleep(moments.uniform(0.0, 1.0))
    proc.send_signal(signal.SIGUSR1)
    if wait_until(proc, lambda: saving(out)):
        proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=600) == EXIT_STOPPED, log.read_text()[-3000:]
    assert "stopped at step" in log.read_text()
    proc = launch(args, log)  # mid-step: a rollout or an update
    assert a_step_done(proc)
    time.sleep(moments.uniform(0.2, 1.5))
    kill_tree(proc)
    proc = launch(args, log)
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    assert log.read_text().count("resumed from step") >= 3
    assert [r["step"] for r in rows(out)] == [r["step"] for r in rows(reference)]
    assert steady(out) == steady(reference)  # bitwise
    assert scalars(out) == scalars(reference)
    assert leftovers(out) == []
    before = sorted((str(p), p.stat().st_mtime_ns) for p in out.rglob("*"))
    proc = launch(args, tmp_path / "again.log")
    assert proc.wait(timeout=120) == 0
    assert "already finished 6 steps" in (tmp_path / "again.log").read_text()
    assert sorted((str(p), p.stat().st_mtime_ns) for p in out.rglob("*")) == before


def test_one_step_off_policy_on_a_separate_rollout_group(workspace, tmp_path):
    """rollout.max_staleness=1: the rollout group generates step k+1 with the weights of step k
    while the trainers update on step k. With a learning rate too small to move a float32
    weight the samples and losses are the on-policy run's; with lr > 0 each batch after the
    first is one update old, its engine log-probs differ from the trainer's recomputed ones
    (TIS corrects them), and its generation overlapped the previous update."""
    common = ("rollout.placement=separate", "rollout.world_size=1", "trainer.max_steps=3",
              "trainer.eval_every_steps=0", "trainer.val_before_train=false")
    frozen = ("actor.optim.lr=1e-30", "actor.optim.min_lr=1e-30")
    runs = {}
    kept = ("trainer.save_every_steps=1", "trainer.keep_last_n=5", "trainer.rollout_data_dir=rollouts")
    for name, extra in {"on_policy_frozen": frozen, "off_frozen": (*frozen, "rollout.max_staleness=1"),
                        "off": ("rollout.max_staleness=1", *kept)}.items():
        out = tmp_path / name
        code, stdout, stderr = finish(ppo(overrides(workspace, out, *common, *extra)))
        assert code == 0, stdout[-3000:] + stderr[-3000:]
        runs[name] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                      if "actor/pg_loss" in line]
    for a, b in zip(runs["on_policy_frozen"], runs["off_frozen"], strict=True):
        for key in ("actor/pg_loss", "actor/kl", "critic/vf_loss", "reward/score_mean",
                    "response/length_mean"):
            assert abs(a[key] - b[key]) < 1e-5, (key, a[key], b[key])
    assert [r["rollout/staleness"] for r in runs["on_policy_frozen"]] == [0.0, 0.0, 0.0]
    off = runs["off"]
    assert [r["rollout/staleness"] for r in off] == [0.0, 1.0, 1.0]
    assert off[0]["rollout/logprob_diff_max"] < 1e-5  # the first batch is on-policy
    for row in off[1:]:
        assert row["rollout/logprob_diff_max"] > 1e-3  # sampled by the previous weights
        assert row["rollout/is_weight_mean"] != 1.0  # corrected (auto: token TIS)
        assert row["timing/overlap"] > 0  # generated while the previous step updated
        assert 0 < row["busy/rollout"] <= 1 and 0 < row["busy/trainers"] <= 1
    # Batch k was sampled by the weights of step k - 1: the engine's log-probs are those weights'
    # (teacher-forced by transformers on the base model / the step-1 checkpoint), not step k's.
    import torch

    from megatron_rlhf.cli import main

    weights = {0: workspace / "base"}
    for step in (1, 2):
        weights[step] = tmp_path / f"hf_{step}"
        assert main(["convert", "mcore-to-hf", "--mcore-dir",
                     str(tmp_path / "off" / "checkpoints" / "actor" / f"step_{step:08d}"),
                     "--out-dir", str(weights[step])]) == 0
    for step in (1, 2):
        dump = (tmp_path / "off" / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in dump]
        assert {r["weight_version"] for r in rows} == {step - 1}
        engine = torch.tensor([lp for r in rows for lp in r["logprobs"]])
        previous, current = (teacher_forced(weights[v], rows) for v in (step - 1, step))
        assert (engine - previous).abs().max() < 1e-5
        assert (engine - current).abs().max() > 1e-3


def teacher_forced(hf_dir: Path, rows: list[dict]):
    """log p(response token) of every dumped sample under the model in ``hf_dir`` (temperature 1)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            start = len(r["prompt_ids"]) - 1
            out.append(logp[start:start + len(r["response_ids"])]
                       .gather(-1, torch.tensor(r["response_ids"])[:, None])[:, 0])
    return torch.cat(out)
