"""PPO recipes end to end through the real command: on-policy GRPO without old/reference
passes, multi-turn retries, hanging and raising reward functions, DAPO/GSPO with rollout
correction, the correction acting on a bf16 engine, training on offline responses."""

import json
import math

import pytest

from tests.ppo_helpers import build_workspace, finish, metrics, overrides, ppo

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return build_workspace(tmp_path_factory)


def test_on_policy_grpo_skips_old_and_reference_passes_without_changing_the_update(workspace, tmp_path):
    """One epoch over one mini-batch: old log-probs come from the update's own forward and no
    reference model is loaded. Forcing both passes back (a zero-weight in-reward KL needs them),
    with one copy of the prompt per sample (``data.share_prompts=false``) where the first run
    shares each group's prompt, must give the same update. Both runs sample dynamically (DAPO's
    filter_groups: a group's replies scored by length, the ties dropped and redrawn) and offload
    the actor between phases, so the shared layout is checked with both."""
    grpo = ["algorithm.adv_estimator=grpo", "rollout.n=4", "actor.ppo_epochs=1",
            "actor.ppo_mini_batch_size=64", "actor.ppo_micro_batch_size_per_rank=16",
            "algorithm.kl_ctrl.type=fixed", "algorithm.kl_ctrl.kl_coef=0", "trainer.max_steps=2",
            "trainer.eval_every_steps=0", "trainer.val_before_train=false",
            "reward.fn=tests.reward_helpers:length_in_tens", "algorithm.filter_groups.enable=true",
            "actor.offload.params=true", "actor.offload.grads=true", "actor.offload.optimizer=true"]
    runs = {}
    for label, kl in (("on_policy", "false"), ("recomputed", "true")):
        out = tmp_path / label
        code, stdout, stderr = finish(ppo(overrides(workspace, out, *grpo,
                                                    f"algorithm.use_kl_in_reward={kl}",
                                                    f"data.share_prompts={kl == 'false'}")))
        assert code == 0, stdout[-3000:] + stderr[-3000:]
        runs[label] = [r for r in metrics(out) if "actor/pg_loss" in r]
    fast, slow = runs["on_policy"], runs["recomputed"]
    assert all("actor/kl" not in r and "rollout/logprob_diff_max" not in r for r in fast)
    assert all("actor/kl" in r and r["rollout/logprob_diff_max"] < 1e-4 for r in slow)
    # Shared: each group's ~20-token prompt once for 4 replies of <= 8 tokens.
    assert all(r["actor/tokens_computed"] < 0.6 * r["actor/tokens_sample"] for r in fast)
    assert all(r["actor/tokens_computed"] == r["actor/tokens_sample"] for r in slow)
    # Dynamic sampling ran alike: the same groups kept and dropped, in the same rounds; the
    # actor's state was offloaded in both.
    assert any(r["dapo/dropped_groups"] > 0 for r in fast), fast
    assert all(r["offload/bytes"] > 0 for r in fast + slow)
    for key in ("dapo/rounds", "dapo/kept_groups", "dapo/dropped_groups", "dapo/trained_groups"):
        assert [r[key] for r in fast] == [r[key] for r in slow], key
    for a, b in zip(fast, slow):
        assert a["actor/ppo_kl"] == 0.0 and a["actor/clipfrac"] == 0.0  # ratio exactly 1
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "reward/score_mean"):
            assert abs(a[key] - b[key]) < 1e-4 * max(1.0, abs(b[key])), (key, a[key], b[key])


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
