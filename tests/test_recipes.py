"""DAPO, GSPO, REINFORCE++, the new loss aggregations and rollout correction: pure functions
against hand-computed values and slow loops (and against verl's own where verl is installed)."""

import math

import pytest
import torch

from megatron_rlhf.algorithms import advantages as adv
from megatron_rlhf.algorithms import dapo, ppo, rollout_correction

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # last row empty


def test_new_aggregation_modes_by_hand():
    assert ppo.aggregate(LOSS, MASK, "token-sum").item() == pytest.approx(10.0)
    # Dr. GRPO: per-sequence sums over a constant horizon (8), mean over the 2 non-empty rows.
    assert ppo.aggregate(LOSS, MASK, "seq-mean-token-sum-norm", horizon=8).item() == \
        pytest.approx((6.0 / 8 + 4.0 / 8) / 2)
    with pytest.raises(ValueError, match="horizon"):
        ppo.aggregate(LOSS, MASK, "seq-mean-token-sum-norm")


@pytest.mark.parametrize("mode", ppo.AGG_MODES)
def test_micro_batches_add_up_to_the_whole(mode):
    # What the trainer does: each micro-batch's aggregate times its denominator, summed, over
    # the mini-batch's denominator, must be the mini-batch's own aggregate.
    generator = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 5, generator=generator)
    mask = (torch.rand(6, 5, generator=generator) > 0.3).float()
    mask[2] = 0.0
    whole = ppo.aggregate(loss, mask, mode, horizon=7)
    parts = [(loss[i:i + 2], mask[i:i + 2]) for i in range(0, 6, 2)]
    total = sum(ppo.aggregate(l, m, mode, 7) * ppo.aggregate_denominator(m, mode, 7) for l, m in parts)
    assert (total / ppo.aggregate_denominator(mask, mode, 7)).item() == pytest.approx(whole.item(), abs=1e-6)


def gspo_loop(old, new, advantages, mask, low, high):
    """Reference GSPO objective, one sequence at a time (value only)."""
    losses = []
    for i in range(old.shape[0]):
        valid = [t for t in range(old.shape[1]) if mask[i, t]]
        if not valid:
            continue
        s = math.exp(sum(new[i, t].item() - old[i, t].item() for t in valid) / len(valid))
        a = advantages[i, valid[0]].item()
        losses.append(max(-a * s, -a * min(max(s, 1 - low), 1 + high)))
    return sum(losses) / len(losses)


def test_gspo_matches_a_loop_and_its_gradient_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.2, 0.4, 0.1]]))
    new = torch.log(torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, 0.1]])).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    advantages = torch.tensor([[1.0], [-2.0]]).expand(2, 3)
    out = ppo.gspo_policy_loss(old, new, advantages, mask, clip_low=0.2, clip_high=0.2)
    assert out.loss.item() == pytest.approx(gspo_loop(old, new.detach(), advantages, mask, 0.2, 0.2))
    out.loss.backward()
    # Row 0: s = sqrt(1.2) inside the clip range: d/dlogp_t = -A * s / |y| / rows.
    s = math.sqrt(0.6 / 0.5)
    assert new.grad[0, :2].tolist() == pytest.approx([-1.0 * s / 2 / 2] * 2)
    assert new.grad[0, 2].item() == 0.0
    # Row 1: ratio 1 exactly, A < 0: gradient +2 * 1 / 3 / 2 on each token.
    assert new.grad[1].tolist() == pytest.approx([2.0 / 3 / 2] * 3)


def test_gspo_clips_whole_sequences():
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[2.0, 2.0]])).requires_grad_()  # s = 2: far outside
    out = ppo.gspo_policy_loss(old, new, torch.ones(1, 2), torch.ones(1, 2), 3e-4, 4e-4)
    assert out.loss.item() == pytest.approx(-(1 + 4e-4)) and out.clipfrac.item() == 1.0
    out.loss.backward()
    assert new.grad.abs().sum().item() == 0.0  # clipped: no gradient, as PPO's clip


def test_reinforce_pp_matches_a_loop():
    rewards = torch.tensor([[0.0, -0.1, 1.0, 0.0], [0.0, 0.5, 0.0, -0.2]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]])
    gamma = 0.9
    advantages, returns = adv.reinforce_pp_advantages(rewards, mask, gamma)
    expected = torch.zeros_like(rewards)
    for b in range(2):
        running = 0.0
        for t in reversed(range(4)):
            if mask[b, t]:
                running = rewards[b, t].item() + gamma * running
                expected[b, t] = running
    assert torch.allclose(returns, expected, atol=1e-6)
    values = expected[mask > 0]
    whitened = (values - values.mean()) / torch.sqrt(values.var(unbiased=True) + 1e-8)
    assert torch.allclose(advantages[mask > 0], whitened, atol=1e-5)
    assert advantages[mask == 0].abs().sum() == 0


def test_reinforce_pp_baseline_by_hand():
    scores = torch.tensor([1.0, 0.0, 3.0, 5.0])
    groups = torch.tensor([0, 0, 1, 2])  # groups 1 and 2 are singletons: they keep their score
    assert adv.group_mean_baseline(scores, groups).tolist() == [0.5, -0.5, 3.0, 5.0]
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    out = adv.reinforce_pp_baseline_advantages(scores, groups, mask)
    tokens = torch.tensor([0.5, 0.5, -0.5, 3.0, 3.0, 5.0])
    whitened = (tokens - tokens.mean()) / torch.sqrt(tokens.var(unbiased=True) + 1e-8)
    assert torch.allclose(out[mask > 0], whitened, atol=1e-5)


def test_dynamic_sampling_drops_groups_whose_scores_are_all_equal():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.7])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 4])
    keep = dapo.groups_with_signal(scores, groups)
    # group 0 all right, group 2 all wrong, groups 3 and 4 singletons: only group 1 has signal
    assert keep.tolist() == [False, False, True, True, False, False, False, False]


def test_overlong_penalty_at_its_boundaries():
    lengths = torch.tensor([0, 12, 16, 18, 20])
    penalty = dapo.overlong_penalty(lengths, max_length=20, buffer=4, penalty_factor=1.5)
    assert penalty.tolist() == pytest.approx([0.0, 0.0, 0.0, -0.75, -1.5])
    with pytest.raises(ValueError):
        dapo.overlong_penalty(lengths, 20, 0)


def test_tis_weights_and_sequence_masks_on_known_values():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.9, 0.9, 0.9]]))
    rollout = torch.log(torch.tensor([[0.25, 0.5, 0.1], [0.9, 0.9, 0.9]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    weights = rollout_correction.tis_weights(old, rollout, mask, cap=2.0)
    assert weights.flatten().tolist() == pytest.approx([2.0, 1.0, 2.0, 1.0, 1.0, 0.0])  # 5 -> 2
    # Row 0: ratios 2, 1, 5 -> product 10, geometric mean 10^(1/3) = 2.154; row 1: 1.
    keep = rollout_correction.sequence_keep(old, rollout, mask, 0.5, 2.0, "geometric")
    assert keep.tolist() == [False, True]
    keep = rollout_correction.sequence_keep(old, rollout, mask, 0.1, 11.0, "sequence")
    assert keep.tolist() == [True, True]
    gap = rollout_correction.mismatch(old, rollout, mask)
    assert gap["rollout/logprob_diff_max"] == pytest.approx(math.log(5.0), abs=1e-6)
    assert gap["rollout/logprob_diff_mean"] == pytest.approx((math.log(2) + math.log(5)) / 5, abs=1e-6)


def test_sequence_tis_weights_equal_a_slow_loop():
    """verl's ``rollout_is=sequence``: each sequence's tokens weighted by its capped product of
    ratios; long sequences (whose product overflows float32) capped, not inf or NaN."""
    gen = torch.Generator().manual_seed(3)
    old = torch.randn(6, 40, generator=gen) - 2
    rollout = old + 0.05 * torch.randn(6, 40, generator=gen)
    rollout[5] -= 3.0  # ratio e^3 per token: e^120 over the row
    mask = (torch.rand(6, 40, generator=gen) > 0.2).float()
    mask[4] = 0.0  # an empty response
    for cap in (1.5, 2.0, 10.0):
        fast = rollout_correction.tis_weights(old, rollout, mask, cap, "sequence")
        for b in range(6):
            product = 1.0
            for t in range(40):
                if mask[b, t]:
                    product *= math.exp(float(old[b, t] - rollout[b, t]))
            weight = min(product, cap)
            for t in range(40):
                assert fast[b, t].item() == pytest.approx(weight if mask[b, t] else 0.0, rel=1e-5)
        assert torch.isfinite(fast).all() and fast[5].max().item() == pytest.approx(cap)
    with pytest.raises(ValueError, match="unknown TIS level"):
        rollout_correction.tis_weights(old, rollout, mask, 2.0, "geometric")


def test_policy_loss_token_weights_scale_each_token():
    old, new = torch.zeros(1, 2), torch.zeros(1, 2)
    weights = torch.tensor([[2.0, 0.5]])
    out = ppo.policy_loss(old, new, torch.ones(1, 2), torch.ones(1, 2), token_weights=weights)
    assert out.loss.item() == pytest.approx(-(2.0 + 0.5) / 2)


# ---------------------------------------------------------------- against verl, where installed
def test_against_verl_where_installed():
    core = pytest.importorskip("verl.trainer.ppo.core_algos")
    generator = torch.Generator().manual_seed(3)
    loss = torch.randn(4, 6, generator=generator)
    mask = (torch.rand(4, 6, generator=generator) > 0.3).float()
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        assert ppo.aggregate(loss, mask, mode).item() == pytest.approx(
            core.agg_loss(loss, mask, mode).item(), abs=1e-6)
    rewards = torch.randn(4, 6, generator=generator) * mask
    config = type("C", (), {"gamma": 0.9, "get": lambda self, k, d=None: getattr(self, k, d)})()
    theirs, _ = core.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config=config)
    ours, _ = adv.reinforce_pp_advantages(rewards, mask, 0.9)
    assert torch.allclose(ours, theirs, atol=1e-5)


# ---------------------------------------------------------------- dynamic sampling's rounds
class _FakeRun:
    """What :func:`rollout_with_signal` uses of a PPO run. Prompt ``i`` is "solved" by a fixed
    pattern: prompts divisible by 3 by every sample, by 3 plus 1 by none, the rest by half."""

    def __init__(self, train_batch_size=4, max_rounds=4, prompts=40):
        from megatron_rlhf.config.ppo_schema import PPOConfig
        from megatron_rlhf.data.prompts import Prompt
        from megatron_rlhf.trainers.rl.agent import PPORun

        self.cfg = PPOConfig()
        self.cfg.data.train_batch_size = train_batch_size
        self.cfg.rollout.n = 2
        self.cfg.algorithm.filter_groups.enable = True
        self.cfg.algorithm.filter_groups.max_rounds = max_rounds
        self.train = [Prompt((5, i), str(i)) for i in range(prompts)]
        self.steps_per_epoch, self.pad_id, self.logs, self.generated = 1, 0, [], []
        self.step_indices = lambda step: PPORun.step_indices(self, step)
        self.extra_indices = lambda *a: PPORun.extra_indices(self, *a)

    def sampling(self, step):
        from megatron_rlhf.rollout.base import SamplingParams

        return SamplingParams(max_tokens=4, n=2, seed=step)

    def generate(self, prompts, params):
        from megatron_rlhf.rollout.base import Generation

        self.generated.append([p.ids[1] for p in prompts])
        return [Generation(i, [7, 8], [-0.5, -0.5], True) for i in range(len(prompts))
                for _ in range(2)]

    def scores(self, prompts, gens, batch):
        def solved(i, sample):
            number = prompts[i].ids[1]
            return 1.0 if number % 3 == 0 else 0.0 if number % 3 == 1 else float(sample)

        score = torch.tensor([solved(g.prompt_index, row % 2) for row, g in enumerate(gens)])
        return {"score": score, "rm": None, "turns": None, "oracle": score.clone()}

    def log(self, message):
        self.logs.append(message)


def _timer():
    from megatron_rlhf.trainers.rl.agent import Timer

    return Timer()


def test_dynamic_sampling_rounds_until_the_batch_has_signal():
    from megatron_rlhf.trainers.rl.dynamic_sampling import rollout_with_signal

    run = _FakeRun(train_batch_size=4)
    prompts, gens, batch, scored, metrics = rollout_with_signal(run, 0, _timer())
    first = run.generated[0]
    with_signal = [n for n in first if n % 3 == 2]
    assert metrics["dapo/rounds"] == len(run.generated) > 1
    assert metrics["dapo/dropped_groups"] + metrics["dapo/kept_groups"] == sum(map(len, run.generated))
    assert metrics["dapo/kept_groups"] >= 4 and metrics["dapo/trained_groups"] == 4
    # Every trained group has signal; later rounds draw prompts the step had not used.
    assert all(p.ids[1] % 3 == 2 for p in prompts) and len(prompts) == 4
    assert [p.ids[1] for p in prompts[:len(with_signal)]] == with_signal[:4]
    seen = [n for round_ in run.generated for n in round_]
    assert len(seen) == len(set(seen))
    assert batch["train_rows"].all() and batch["input_ids"].shape[0] == len(gens) == 8
    assert scored["score"].shape == (8,) and all(g.prompt_index == i // 2 for i, g in enumerate(gens))
    # The same step draws the same extra prompts again (a resumed run repeats itself).
    again = _FakeRun(train_batch_size=4)
    rollout_with_signal(again, 0, _timer())
    assert again.generated == run.generated


def test_dynamic_sampling_trains_on_what_it_has_when_rounds_run_out():
    from megatron_rlhf.trainers.rl.dynamic_sampling import rollout_with_signal

    run = _FakeRun(train_batch_size=6, max_rounds=1)
    prompts, gens, batch, scored, metrics = rollout_with_signal(run, 0, _timer())
    kept = metrics["dapo/kept_groups"]
    assert metrics["dapo/rounds"] == 1 and kept < 6 and len(prompts) == 6
    # The batch keeps its size; the groups without signal are there but out of the loss.
    assert batch["train_rows"].tolist() == [True] * (2 * kept) + [False] * (2 * (6 - kept))
    assert run.logs and "groups had signal after 1 rounds" in run.logs[0]
