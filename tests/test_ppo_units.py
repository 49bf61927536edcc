"""PPO pieces that need no process: batch layout, advantages, config checks, loss scaling."""

import pytest
import torch

from megatron_rlhf.algorithms.advantages import compute_gae, masked_whiten
from megatron_rlhf.config.loader import load_config
from megatron_rlhf.config.ppo_checks import check_layout, optimizer_steps, validate_ppo_config
from megatron_rlhf.config.ppo_schema import AlgorithmConfig, PPOConfig
from megatron_rlhf.errors import UserError
from megatron_rlhf.rollout.base import Generation
from megatron_rlhf.trainers.rl.experience import build_batch, compute_advantages, sample_kl
from megatron_rlhf.trainers.rl.micro_batches import dp_slice


def test_build_batch_puts_response_tokens_on_the_target_grid():
    prompts = [(10, 11, 12), (20, 21)]
    gens = [Generation(1, [5, 6, 2], [-0.1, -0.2, -0.3], True),
            Generation(0, [7], [-0.5], False)]
    batch = build_batch(prompts, gens, pad_id=0)
    assert batch["input_ids"].tolist() == [[20, 21, 5, 6, 2], [10, 11, 12, 7, 0]]
    # Position t predicts token t+1: the mask covers the positions predicting response tokens.
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 1, 0], [0, 0, 1, 0, 0]]
    assert batch["targets"][0, 1:4].tolist() == [5, 6, 2]
    assert batch["targets"][1, 2].item() == 7
    assert batch["lengths"].squeeze(1).tolist() == [5, 4]
    assert batch["group"].tolist() == [1, 0]


def _batch():
    gens = [Generation(i // 2, [1] * (2 + i), [0.0] * (2 + i), True) for i in range(4)]
    batch = build_batch([(9, 9), (8, 8, 8)], gens, pad_id=0)
    generator = torch.Generator().manual_seed(0)
    shape = batch["loss_mask"].shape
    batch["old_logprobs"] = -torch.rand(shape, generator=generator) * batch["loss_mask"]
    batch["ref_logprobs"] = -torch.rand(shape, generator=generator) * batch["loss_mask"]
    batch["values"] = torch.randn(shape, generator=generator) * batch["loss_mask"]
    return batch


def test_gae_with_kl_in_reward_matches_the_pieces():
    batch = _batch()
    scores = torch.tensor([1.0, -1.0, 0.5, 2.0])
    cfg = AlgorithmConfig(use_kl_in_reward=True, kl_penalty="k1", gamma=0.9, lam=0.8)
    out = compute_advantages(batch, scores, cfg, kl_coef=0.1)
    mask = batch["loss_mask"]
    kl = (batch["old_logprobs"] - batch["ref_logprobs"]) * mask
    rewards = -0.1 * kl
    for row in range(4):
        last = int(mask[row].nonzero()[-1])
        rewards[row, last] += scores[row]
    assert torch.allclose(out["rewards"], rewards)
    advantages, returns = compute_gae(rewards, batch["values"], mask, 0.9, 0.8)
    assert torch.allclose(out["advantages"], masked_whiten(advantages, mask))
    assert torch.allclose(out["returns"], returns)


def test_grpo_advantage_is_the_group_normalised_score_on_every_token():
    batch = _batch()
    scores = torch.tensor([1.0, 0.0, 3.0, 1.0])
    out = compute_advantages(batch, scores, AlgorithmConfig(adv_estimator="grpo"), kl_coef=0.0)
    per_sample = torch.tensor([1, -1, 1, -1]) / torch.tensor(2.0).sqrt()  # (x - mean) / std, n=2
    expected = per_sample[:, None] * batch["loss_mask"]
    assert torch.allclose(out["advantages"], expected, atol=1e-5)


def test_micro_denominators_rebuild_the_mini_batch_aggregate():
    # Row 4 is an empty response: the sequence means count the 4 other rows only (as verl).
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1], [0, 0, 0]])
    loss = torch.arange(15.0).reshape(5, 3)
    full = mask[:4]
    for mode, whole in (("token-mean", (loss * mask).sum() / mask.sum()),
                        ("seq-mean-token-sum", (loss[:4] * full).sum(1).mean()),
                        ("seq-mean-token-mean", ((loss[:4] * full).sum(1) / full.sum(1)).mean())):
        from megatron_rlhf.algorithms.ppo import aggregate, aggregate_denominator

        parts = [(loss[:1], mask[:1]), (loss[1:], mask[1:])]
        denominator = mask.sum() if mode == "token-mean" else 4.0
        rebuilt = sum(aggregate(l, m, mode) * aggregate_denominator(m, mode) for l, m in parts) / denominator
        assert torch.allclose(rebuilt, whole)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_logged_value_loss_is_the_optimised_mini_batch_loss(mode):
    """Micro-batches of unequal token counts: the logged loss is the whole batch's aggregate in
    every loss_agg_mode (sequence means were once weighted by tokens)."""
    from megatron_rlhf.algorithms.ppo import value_loss
    from megatron_rlhf.trainers.rl.losses import critic_loss
    from megatron_rlhf.trainers.rl.worker import CRITIC_KEYS, _average

    generator = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 1]])
    output, old, returns = (torch.randn(4, 4, generator=generator) for _ in range(3))
    batch = {"input_ids": torch.zeros(4, 4, dtype=torch.long), "loss_mask": mask,
             "values": old, "returns": returns}
    sums = dict.fromkeys(CRITIC_KEYS, 0.0)
    for rows in (slice(0, 1), slice(1, 4)):
        micro = {k: v[rows] for k, v in batch.items()} | {"loss_weight": 1.0}
        _, metrics = critic_loss(output[rows, :, None], micro, cliprange_value=0.2, agg_mode=mode,
                                 horizon=4)
        sums = {k: sums[k] + float(metrics[k]) for k in CRITIC_KEYS}
    logged = _average([sums | {"grad_norm": 0.0, "lr": 0.0}], "critic")["critic/vf_loss"]
    whole, _ = value_loss(output, old, returns, mask, 0.2, mode)
    assert logged == pytest.approx(float(whole), rel=1e-6)


def test_dr_grpo_centres_scores_without_dividing_by_the_std():
    batch = _batch()
    scores = torch.tensor([1.0, 0.0, 3.0, 1.0])
    cfg = AlgorithmConfig(adv_estimator="grpo", norm_adv_by_std_in_grpo=False)
    out = compute_advantages(batch, scores, cfg, kl_coef=0.0)
    expected = torch.tensor([0.5, -0.5, 1.0, -1.0])[:, None] * batch["loss_mask"]
    assert torch.allclose(out["advantages"], expected)


def test_dp_slices_cover_every_row_once():
    for count, dp in ((10, 3), (8, 2), (3, 4)):
        rows = [i for rank in range(dp) for i in range(count)[dp_slice(count, dp, rank)]]
        assert rows == list(range(count))


def _config(*overrides):
    base = ["actor.model_path=x", "data.train_files=[a.parquet]", "reward.fn=addition"]
    return load_config(PPOConfig, None, base + list(overrides))


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.adv_estimator=grpo"], "set rollout.n >= 2"),
    (["reward.fn=null"], "set reward.model_path"),
    (["data.train_batch_size=10", "actor.ppo_mini_batch_size=4"], "not divisible by actor.ppo_mini_batch_size=4"),
    (["algorithm.kl_penalty=k9"], "algorithm.kl_penalty='k9' must be one of"),
    (["actor.clip_ratio_c=0.5"], "must exceed 1"),
    (["rollout.backend=vllm"], "rollout.backend='vllm'"),
    (["trainer.rollback.lr_factor=2"], "trainer.rollback needs"),
    (["rollout.max_turns=2", "reward.fn=null", "reward.model_path=/rm"], "rollout.max_turns=2 needs reward.fn"),
    (["algorithm.ref_log_prob=never"], "algorithm.ref_log_prob='never' must be one of"),
    (["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0"], "target_kl=0"),
    (["critic.ppo_epochs=-1"], "critic.ppo_epochs=-1 must be positive"),
    (["rollout.top_k=-2"], "rollout.top_k=-2"),
    (["rollout.backend=sglang", "rollout.tp=4", "rollout.ep=3"],
     "rollout.ep=3 must be a divisor of rollout.tp=4"),
    (["rollout.tp=4", "rollout.ep=2"], "rollout.ep=2 must be 1 or rollout.tp=4"),
    (["rollout.ep=0"], "rollout.ep=0 must be positive"),
    (["actor.logprob_chunk_tokens=-1"], "actor.logprob_chunk_tokens must be >= 0"),
    (["actor.ppo_micro_batch_tokens_per_rank=10"],
     "actor.ppo_micro_batch_tokens_per_rank=10 cannot hold one sample"),
    (["actor.ppo_micro_batch_tokens_per_rank=4096", "data.use_remove_padding=false"],
     "it needs data.use_remove_padding=true"),
    (["algorithm.rollout_correction.bypass=true", "algorithm.rollout_correction.mode=tis"],
     "rollout_correction.bypass takes the engine's log-probs as the old ones"),
    (["algorithm.rollout_correction.mode=tis", "algorithm.rollout_correction.tis_level=geo"],
     "algorithm.rollout_correction.tis_level='geo' must be one of"),
    (["rollout.placement=elsewhere"], "rollout.placement='elsewhere' must be colocated or separate"),
    (["rollout.placement=separate", "rollout.world_size=3", "rollout.tp=2"],
     "rollout.tp=2 does not divide the separate rollout group's rollout.world_size=3 ranks"),
    (["algorithm.adv_estimator=grpo", "rollout.n=2", "trainer.critic_warmup=5"], "critic_warmup=5"),
    (["actor.optim.lr=nan"], "actor.optim.lr=nan must be a finite number"),
    (["critic.optim.weight_decay=-5"], "critic.optim.weight_decay=-5.0 must be >= 0"),
    (["actor.optim.betas=[0.9,1.5]"], "actor.optim.betas=[0.9, 1.5]"),
    (["rollout.top_p=0"], "rollout.top_p=0.0 must be in (0, 1]"),
    (["rollout.top_p=1.5"], "rollout.top_p=1.5 must be in (0, 1]"),
    (["rollout.val_temperature=-1"], "rollout.val_temperature=-1.0 must be >= 0"),
    (["actor.clip_ratio=-1"], "actor.clip_ratio=-1.0 must be positive"),
    (["resource_pool.critic=separate", "resource_pool.critic_world_size=0"],
     "resource_pool.critic_world_size=0 must be positive"),
    (["algorithm.filter_groups.enable=true"], "algorithm.adv_estimator=gae has none"),
    (["algorithm.adv_estimator=grpo", "rollout.n=2", "algorithm.filter_groups.enable=true",
      "algorithm.filter_groups.oversample=0.5"], "filter_groups.oversample=0.5 must be >= 1"),
    (["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=600"],
     "reward.overlong_buffer.len=600 must be in (0, data.max_response_length=512]"),
    (["actor.policy_loss=gpo"], "actor.policy_loss='gpo' must be one of vanilla, gspo"),
    (["actor.loss_agg_mode=token-max"], "actor.loss_agg_mode='token-max'"),
    (["algorithm.adv_estimator=reinforce"], "algorithm.adv_estimator='reinforce'"),
    (["algorithm.rollout_correction.mode=tis", "algorithm.rollout_correction.mask_high=0.9"],
     "0 < mask_low < 1 < mask_high"),
])
def test_bad_ppo_configs_name_the_key(overrides, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("[", r"\[")):
        validate_ppo_config(_config(*overrides))


def test_sglang_engines_on_a_separate_rollout_group_are_accepted():
    """The separate group's ranks receive the buckets over the bridge on their own GPUs and hand
    them to SGLang as colocated ranks do (CUDA IPC); one-step-off works the same way."""
    cfg = validate_ppo_config(_config("rollout.backend=sglang", "rollout.placement=separate",
                                      "rollout.world_size=4", "rollout.tp=2",
                                      "rollout.max_staleness=1"))
    assert (cfg.rollout.backend, cfg.rollout.placement, cfg.rollout.max_staleness) == (
        "sglang", "separate", 1)


def test_layout_check_names_the_micro_batch():
    cfg = validate_ppo_config(_config("actor.ppo_mini_batch_size=16",
                                      "actor.ppo_micro_batch_size_per_rank=3"))
    with pytest.raises(UserError, match="ppo_micro_batch_size_per_rank=3"):
        check_layout(cfg, world=2, dp=2)
    with pytest.raises(UserError, match="rollout.tp=2"):
        check_layout(validate_ppo_config(_config("rollout.tp=2")), world=3, dp=3)
    # A separate critic group generates nothing: the rollout's TP does not constrain it.
    check_layout(validate_ppo_config(_config("rollout.tp=2")), world=1, dp=1, generates=False)
    # Engines never straddle two nodes: 2 nodes of 3 ranks cannot hold engines of 2.
    straddling = validate_ppo_config(_config("rollout.tp=2", "trainer.n_gpus_per_node=3",
                                             "trainer.nnodes=2"))
    with pytest.raises(UserError, match="rollout.tp=2 does not divide the 3 GPUs of a node"):
        check_layout(straddling, world=6, dp=6)
    check_layout(validate_ppo_config(_config("rollout.tp=4", "trainer.n_gpus_per_node=2",
                                             "trainer.nnodes=2")), world=4, dp=4)  # two nodes


def test_multi_turn_rollout_retries_unsolved_turns_only():
    from megatron_rlhf.rollout.base import SamplingParams
    from megatron_rlhf.rollout.multi_turn import run_turns

    calls = []

    def generate(prompts, params):
        # An engine stand-in: answer 50 + prompt length; prompt 1's first answer is cut off.
        calls.append([list(p) for p in prompts])
        return [Generation(i, [50 + len(p), 2], [-0.5, -0.25], not (len(p) == 2 and len(calls) == 1))
                for i, p in enumerate(prompts) for _ in range(params.n)]

    score = lambda i, tokens: float(tokens[0] > 56)  # noqa: E731  only a longer context solves it
    feedback = [90, 91]
    out = run_turns(generate, [[1, 2, 3], [4, 5]], SamplingParams(max_tokens=4), score, 3, feedback)
    # Prompt 0: turn 1 wrong (53) -> feedback -> turn 2 answers 50 + 3 + 2 + 2 = 57: solved, stop.
    first = out[0]
    assert first.tokens == [53, 2, 90, 91, 57, 2]
    assert first.mask == [1, 1, 0, 0, 1, 1]
    assert first.logprobs == [-0.5, -0.25, 0.0, 0.0, -0.5, -0.25]
    assert first.turn_ends == [1, 5] and first.turn_scores == [0.0, 1.0]
    # Prompt 1 hit max_tokens without a stop token: the episode ends after one turn.
    assert out[1].turn_ends == [1] and out[1].mask == [1, 1]
    assert calls[1] == [[1, 2, 3, 53, 2, 90, 91]] and len(calls) == 2


def test_multi_turn_gae_puts_each_turn_reward_on_its_last_token():
    from megatron_rlhf.algorithms.advantages import turn_rewards

    gens = [Generation(0, [5, 6, 90, 91, 7, 8], [0.0] * 6, True, mask=[1, 1, 0, 0, 1, 1],
                       turn_ends=[1, 5], turn_scores=[0.0, 1.0])]
    batch = build_batch([(10, 11)], gens, pad_id=0)
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0, 0, 1, 1, 0]]
    turns = turn_rewards([[-0.5, 1.0]], [[1 + 1, 1 + 5]], 8)
    batch["values"] = torch.zeros(1, 8)
    batch["old_logprobs"] = batch["ref_logprobs"] = torch.zeros(1, 8)
    cfg = AlgorithmConfig(gamma=1.0, lam=1.0, whiten_advantages=False)
    out = compute_advantages(batch, torch.tensor([0.5]), cfg, kl_coef=0.0, turns=turns)
    assert out["rewards"].tolist() == [[0, 0, -0.5, 0, 0, 0, 1.0, 0]]
    # Reward-to-go over the policy's tokens; environment tokens get nothing.
    assert out["advantages"].tolist() == [[0, 0.5, 0.5, 0, 0, 1.0, 1.0, 0]]


def test_passes_are_skipped_only_when_nothing_needs_them():
    from megatron_rlhf.config.ppo_checks import reuses_update_log_probs, uses_reference

    assert not uses_reference(_config())  # no KL term, no KL guard
    for extra in (["algorithm.use_kl_in_reward=true"], ["actor.use_kl_loss=true"],
                  ["trainer.rollback.kl_threshold=0.5"], ["algorithm.ref_log_prob=always"]):
        assert uses_reference(_config(*extra)), extra
    on_policy = ["actor.ppo_epochs=1", "data.train_batch_size=8", "rollout.n=2",
                 "actor.ppo_mini_batch_size=16"]
    assert reuses_update_log_probs(_config(*on_policy))
    for extra in (["actor.ppo_epochs=2"], ["actor.ppo_mini_batch_size=8"],
                  ["algorithm.use_kl_in_reward=true"]):
        assert not reuses_update_log_probs(_config(*on_policy, *extra)), extra


def test_sample_kl_is_the_per_token_mean_per_response_averaged_like_verl():
    kl = torch.tensor([[9.0, 0.2, 0.4, 0.0], [9.0, 9.0, 0.3, 9.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    # Response means 0.3 and 0.3, not the sums 0.6 and 0.3: the target is per token.
    assert sample_kl(kl, mask) == pytest.approx(0.3)
    assert sample_kl(kl, torch.zeros_like(mask)) == 0.0


def _fake_checkpoints(root, role, steps):
    from megatron_rlhf.checkpoint.model_ckpt import META_FILE

    for step in steps:
        (root / role / f"step_{step:08d}").mkdir(parents=True, exist_ok=True)
        (root / role / f"step_{step:08d}" / META_FILE).write_text("{}")


def test_a_kill_between_two_models_saves_leaves_a_step_to_resume_and_pruning_heals(tmp_path):
    from megatron_rlhf.trainers.rl.agent import PPORun

    cfg = _config(f"trainer.output_dir={tmp_path}", "trainer.keep_last_n=1", "algorithm.adv_estimator=gae")
    run = PPORun(cfg, None, None, None, [], [], [], None, None, 10, 10)
    root = run.ckpt_root
    # Step 20: the actor saved, then the job died before the critic did (nothing pruned yet).
    _fake_checkpoints(root, "actor", [10, 20])
    _fake_checkpoints(root, "critic", [10])
    assert run.checkpoints() == [10]
    # Resumed at 10; its next save is step 12, for both models: the abandoned 20 goes too.
    _fake_checkpoints(root, "actor", [12])
    _fake_checkpoints(root, "critic", [12])
    run.prune()
    assert {p.name for p in (root / "actor").iterdir()} == {"step_00000012"}
    assert {p.name for p in (root / "critic").iterdir()} == {"step_00000012"}
    # A metrics line cut off by the kill does not stop the resume.
    (tmp_path / "metrics.jsonl").write_text('{"step": 11}\n{"step": 12}\n{"step": 13, "a": 1.')
    from megatron_rlhf.trainers.rl.run import RLRun

    RLRun(cfg, {"actor": run}, None, 10).trim_metrics(12)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 11}\n{"step": 12}\n'


def test_each_model_schedules_its_own_epochs():
    cfg = _config("data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=16",
                  "actor.ppo_epochs=1", "critic.ppo_epochs=4")
    # 32 samples a step in mini-batches of 16: 2 optimizer steps per epoch, over 10 steps.
    assert optimizer_steps(cfg, total_steps=10, samples_per_step=32) == {"actor": 20, "critic": 80}
    # A partial last mini-batch is an optimizer step too (the update makes one for it): 40
    # samples take 3 steps per epoch, not 2 (the single-agent schedule had rounded down).
    assert optimizer_steps(cfg, total_steps=10, samples_per_step=40) == {"actor": 30, "critic": 120}
    assert optimizer_steps(cfg, 10, 40, critic=False)["critic"] == 0


def test_ranks_without_rows_do_not_drop_the_others_results():
    from megatron_rlhf.trainers.rl.agent import cat_rows

    # 1 validation prompt on 2 data-parallel ranks: rank 0 got no rows.
    assert cat_rows([None, torch.tensor([0.5])]).tolist() == [0.5]
    assert cat_rows([None, None]) is None


def test_rollback_hides_the_undone_steps_in_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_rlhf.monitoring import MetricsLogger

    logger = MetricsLogger(str(tmp_path), "tensorboard", total_steps=4, enabled=True)
    for step in (1, 2, 3):
        logger.scalars(step, {"x": float(step)})
    logger.rewind(2)  # step 3 was undone; its redo is logged again
    logger.scalars(3, {"x": 30.0})
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("x")] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_mini_batch_denominator_counts_non_empty_responses():
    from megatron_rlhf.algorithms.ppo import aggregate_denominator

    mask = torch.tensor([[1.0, 1, 0], [0, 0, 0], [1, 1, 1], [0, 0, 0]])
    _denominator = lambda rows, mode: float(aggregate_denominator(mask[rows], mode, 8))  # noqa: E731
    assert _denominator([0, 1, 2], "seq-mean-token-sum") == 2.0
    assert _denominator([1, 3], "seq-mean-token-mean") == 1.0  # nothing to train: no 0/0
    assert _denominator([0, 1, 2, 3], "token-mean") == 5.0
    assert _denominator([0, 1, 2], "seq-mean-token-sum-norm") == 16.0  # 2 responses x horizon 8
    assert _denominator([0, 1, 2], "token-sum") == 1.0


def test_the_experience_batch_holds_only_declared_fields():
    """What the driver builds and the stages add is the documented ``Experience`` type; a
    stage writing an undeclared field is stopped at the update, naming it."""
    from megatron_rlhf.rollout.base import Generation
    from megatron_rlhf.trainers.rl.experience import (EXPERIENCE_FIELDS, build_batch,
                                                      check_experience)

    gens = [Generation(0, [5, 6], [-0.1, -0.2], True), Generation(1, [7], [-0.3], False)]
    batch = build_batch([(1, 2), (3,)], gens, pad_id=0)
    assert set(batch) == {"input_ids", "targets", "loss_mask", "lengths", "group"}
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0], [1, 0, 0, 0]]  # the target grid
    batch.update(values=None, scores_from_rm=False, advantages=torch.zeros(2, 4),
                 returns=torch.zeros(2, 4))
    check_experience(batch, "here")
    assert {"old_logprobs", "ref_logprobs", "is_weights", "train_rows", "response_mask",
            "preferences", "population_group", "population_rows"} <= EXPERIENCE_FIELDS
    with pytest.raises(TypeError, match=r"step 3, agent a: .*undeclared field\(s\) \['scores'\]"):
        check_experience({**batch, "scores": torch.zeros(2)}, "step 3, agent a")


def test_busy_fractions_count_a_separate_groups_generation_apart():
    from megatron_rlhf.trainers.rl.ahead import busy_fractions

    timing = {"timing/gen": 2.0, "timing/update_actor": 3.0, "timing/sync": 1.0, "timing/overlap": 1.5}
    assert busy_fractions(timing, 8.0, separate=False) == {"busy/trainers": 0.75}
    # Separate: the trainers only waited for the generation; the rollout group's own span counts.
    assert busy_fractions(timing | {"busy/rollout_seconds": 4.0}, 8.0, separate=True) == {
        "busy/trainers": 0.5, "busy/rollout": 0.5}
    assert busy_fractions(timing, 8.0, separate=True)["busy/rollout"] == 0.25


def test_the_kl_guard_refuses_to_pass_an_update_that_reported_no_kl():
    """A configured KL guard with its metric missing is an error, never a pass (a missing
    ``actor/kl`` once read as 0); NaN losses and a KL over the line are reasons to roll back."""
    from types import SimpleNamespace

    from megatron_rlhf.trainers.rl.agent import PPORun

    run = SimpleNamespace(cfg=load_config(PPOConfig, None, ["actor.model_path=x",
                                                            "trainer.rollback.kl_threshold=0.5"]))
    assert PPORun.guard_reason(run, {"actor/pg_loss": 0.1, "actor/kl": 0.2}) is None
    assert "exceeds trainer.rollback.kl_threshold=0.5" in PPORun.guard_reason(
        run, {"actor/pg_loss": 0.1, "actor/kl": 0.7})
    assert PPORun.guard_reason(run, {"actor/pg_loss": float("nan"), "actor/kl": 0.2}) == "actor/pg_loss is nan"
    assert PPORun.guard_reason(run, {"critic/vf_loss": 0.3}) is None  # no actor update this step
    with pytest.raises(RuntimeError, match="reported no actor/kl"):
        PPORun.guard_reason(run, {"actor/pg_loss": 0.1})
