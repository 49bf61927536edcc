"""Pure algorithm functions against hand-computed values and slow reference loops."""

import math

import pytest
import torch

from megatron_rlhf.algorithms import advantages as adv
from megatron_rlhf.algorithms import ppo


def gae_loop(rewards, values, mask, gamma, lam):
    """Reference: per sequence, over the list of valid positions only."""
    out_adv, out_ret = torch.zeros_like(values), torch.zeros_like(values)
    for b in range(rewards.shape[0]):
        valid = [t for t in range(rewards.shape[1]) if mask[b, t]]
        running = 0.0
        for i in reversed(range(len(valid))):
            t = valid[i]
            next_value = values[b, valid[i + 1]].item() if i + 1 < len(valid) else 0.0
            delta = rewards[b, t].item() + gamma * next_value - values[b, t].item()
            running = delta + gamma * lam * running
            out_adv[b, t] = running
            out_ret[b, t] = running + values[b, t].item()
    return out_adv, out_ret


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    a, r = adv.compute_gae(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.8)
    d2 = 1.0 - 0.7
    d1 = 0.0 + 0.9 * 0.7 - 0.6
    d0 = 0.0 + 0.9 * 0.6 - 0.5
    a2, a1 = d2, d1 + 0.72 * d2
    a0 = d0 + 0.72 * a1
    assert torch.allclose(a, torch.tensor([[a0, a1, a2]]), atol=1e-6)
    assert torch.allclose(r, a + values)


def test_gae_matches_loop_with_padding_in_the_middle():
    torch.manual_seed(0)
    rewards, values = torch.randn(5, 9), torch.randn(5, 9)
    mask = (torch.rand(5, 9) > 0.3).float()
    mask[:, -2:] = 0  # right padding too
    mask[2] = 0  # an empty row
    got = adv.compute_gae(rewards, values, mask, gamma=0.99, lam=0.95)
    want = gae_loop(rewards, values, mask, 0.99, 0.95)
    assert torch.allclose(got[0], want[0], atol=1e-5) and torch.allclose(got[1], want[1], atol=1e-5)
    assert (got[0][mask == 0] == 0).all()


def test_gae_lambda_one_gamma_one_is_return_minus_value():
    rewards, values = torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[0.1, 0.2, 0.3]])
    a, _ = adv.compute_gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    assert torch.allclose(a, torch.tensor([[6.0, 5.0, 3.0]]) - values)


def test_discounted_returns_skip_environment_tokens():
    rewards = torch.tensor([[0.0, 9.0, 1.0, 0.0, 2.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0, 1.0]])  # tokens 1 and 3 came from the environment
    got = adv.discounted_returns(rewards, mask, gamma=0.5)
    assert torch.allclose(got, torch.tensor([[0.5 * (1 + 0.5 * 2), 0.0, 1 + 0.5 * 2, 0.0, 2.0]]))


def test_turn_rewards_land_on_turn_ends():
    r = adv.turn_rewards([[1.0, 0.5], [2.0]], [[2, 5], [3]], length=6)
    assert r.tolist() == [[0, 0, 1, 0, 0, 0.5], [0, 0, 0, 2, 0, 0]]


def test_token_level_rewards_with_kl():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    kl = torch.full((2, 4), 0.5)
    r = adv.token_level_rewards(torch.tensor([1.0, -1.0]), mask, kl, kl_coef=0.1)
    assert torch.allclose(r, torch.tensor([[-0.05, -0.05, 0.95, 0.0], [-0.05, -1.05, 0.0, 0.0]]))


def test_masked_whiten():
    x, mask = torch.tensor([[1.0, 2.0, 3.0, 100.0]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = adv.masked_whiten(x, mask)
    assert torch.allclose(w, torch.tensor([[-1.0, 0.0, 1.0, 0.0]]), atol=1e-4)


def test_group_advantages():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 5.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    grpo = adv.group_normalized_advantages(scores, groups)
    std = torch.tensor([1.0, 0.0, 0.0]).std()
    assert torch.allclose(grpo[:3], (torch.tensor([1.0, 0.0, 0.0]) - 1 / 3) / (std + 1e-6))
    assert grpo[3:].tolist() == [0.0, 0.0, 0.0]  # constant group and a singleton
    rloo = adv.rloo_advantages(scores, groups)
    assert torch.allclose(rloo[:3], torch.tensor([1.0, -0.5, -0.5]))


def test_aggregation_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert ppo.aggregate(loss, mask, "token-mean").item() == pytest.approx(2.5)
    assert ppo.aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx(5.0)
    assert ppo.aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)


def test_policy_loss_clipping_by_hand():
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.1]]))
    advantage = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    out = ppo.policy_loss(old, new, advantage, torch.ones(1, 4), 0.2, 0.28, dual_clip=None)
    # 1.5 > 1.28 with A>0: clipped to -1.28; 0.5 < 0.8 with A<0: max(0.5, 0.8) = 0.8;
    # 1.1 in range: -1.1; 0.1 with A<0: max(0.1, 0.8) = 0.8.
    assert out.loss.item() == pytest.approx((-1.28 + 0.8 - 1.1 + 0.8) / 4, abs=1e-6)
    assert out.clipfrac.item() == pytest.approx(0.75)


def test_dual_clip_bounds_negative_advantages():
    old, new = torch.zeros(1, 2), torch.log(torch.tensor([[10.0, 10.0]]))
    advantage = torch.tensor([[-1.0, 1.0]])
    out = ppo.policy_loss(old, new, advantage, torch.ones(1, 2), 0.2, 0.2, dual_clip=3.0)
    # A<0: max(10, 1.2) = 10, dual clip -> 3; A>0: max(-10, -1.2) = -1.2.
    assert out.loss.item() == pytest.approx((3.0 - 1.2) / 2)
    assert out.dual_clipfrac.item() == pytest.approx(0.5)


def test_value_loss_clipping():
    values, old, returns = torch.tensor([[2.0, 0.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    loss, frac = ppo.value_loss(values, old, returns, torch.ones(1, 2), cliprange_value=0.5)
    # token 0: unclipped 4, clipped (0.5)^2 = 0.25 -> 4; token 1: 1, 1 -> 1.
    assert loss.item() == pytest.approx(0.5 * 2.5) and frac.item() == 0.0
    loss, _ = ppo.value_loss(torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.tensor([[2.0]]),
                             torch.ones(1, 1), cliprange_value=0.2)
    assert loss.item() == pytest.approx(0.5 * 4.0)  # clipped (0.8 - 2)^2 = 1.44 < 4


def test_kl_estimators_properties():
    torch.manual_seed(0)
    p_logits, q_logits = torch.randn(6), torch.randn(6)
    logp, logq = torch.log_softmax(p_logits, 0), torch.log_softmax(q_logits, 0)
    true_kl = (logp.exp() * (logp - logq)).sum().item()
    samples = torch.multinomial(logp.exp(), 400_000, replacement=True)
    lp, lq = logp[samples], logq[samples]
    k1, k3 = ppo.kl_estimate(lp, lq, "k1"), ppo.kl_estimate(lp, lq, "k3")
    assert k1.mean().item() == pytest.approx(true_kl, abs=0.01)  # unbiased
    assert k3.mean().item() == pytest.approx(true_kl, abs=0.01)  # unbiased
    assert (k3 >= 0).all() and k3.var() < k1.var()  # non-negative, lower variance
    assert (ppo.kl_estimate(lp, lq, "abs") >= 0).all()
    assert torch.allclose(ppo.kl_estimate(lp, lq, "mse"), 0.5 * (lp - lq) ** 2)
    assert torch.equal(ppo.kl_estimate(lp, lq, "k2"), ppo.kl_estimate(lp, lq, "mse"))
    assert torch.equal(ppo.kl_estimate(lp, lq, "low_var_kl"), k3)
    with pytest.raises(ValueError):
        ppo.kl_estimate(lp, lq, "k4")


def test_adaptive_kl_controller():
    ctrl = ppo.AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctrl.update(current_kl=12.0, n_steps=100)  # error clipped to +0.2
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 10000))
    ctrl.update(current_kl=3.0, n_steps=100)  # error -0.5 clipped to -0.2
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.002) * (1 - 0.002))
    fixed = ppo.FixedKLController(0.05)
    fixed.update(100.0, 1000)
    assert fixed.value == 0.05


def test_entropy_and_explained_variance():
    assert ppo.entropy_from_logits(torch.zeros(2, 4)).allclose(torch.full((2,), math.log(4)))
    returns = torch.tensor([[1.0, 2.0, 3.0]])
    assert ppo.explained_variance(returns, returns, torch.ones(1, 3)) == pytest.approx(1.0)


def test_sequence_means_leave_empty_rows_out_as_verl():
    """One empty response in three: verl's agg_loss divides by the 2 non-empty rows, so the
    seq-mean modes give 1.5x what a mean over all 3 rows would (-0.743 vs -0.495 in the issue)."""
    loss = torch.tensor([[-0.3, -0.2, -0.1], [-0.5, -0.4, 0.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    # by hand: row sums -0.6 and -0.9, row means -0.2 and -0.45; the empty row counts nowhere
    assert ppo.aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx(-0.75)
    assert ppo.aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx(-0.325)
    assert ppo.aggregate(loss, mask, "token-mean").item() == pytest.approx(-1.5 / 5)
    nothing = torch.zeros(2, 3)
    assert ppo.aggregate(loss[:2], nothing, "seq-mean-token-sum").item() == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum",
                                  "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_masked_positions_never_reach_the_loss(mode):
    """A masked position holding inf or NaN (a padded position's log-ratio): the loss is that
    of the unmasked ones, as verl zeroes masked values before aggregating."""
    for bad in (math.inf, math.nan):
        loss = torch.tensor([[1.0, bad]])
        got = ppo.aggregate(loss, torch.tensor([[1.0, 0.0]]), mode, horizon=1)
        assert got.item() == 1.0


def test_every_registered_estimator_gives_per_token_advantages_on_the_mask():
    """The registry's entries, fed one batch: ``[N, T]`` rewards, advantages and returns, zero
    off the mask; the config's lists are the registry's."""
    from types import SimpleNamespace

    from megatron_rlhf.algorithms.estimators import ESTIMATORS, Inputs
    from megatron_rlhf.config.ppo_checks import ADV_ESTIMATORS, GROUP_ESTIMATORS

    settings = SimpleNamespace(gamma=1.0, lam=0.95, whiten_advantages=True,
                               norm_adv_by_std_in_grpo=True, use_kl_in_reward=True,
                               sppo_target="win_rate", sppo_beta=1.0, sppo_softmean_scope="prompt")
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    inputs = Inputs(torch.tensor([1.0, 0.0, 0.5, 2.0]), mask, torch.tensor([0, 0, 1, 1]),
                    torch.full((4, 3), 0.1) * mask, 0.05, values=torch.rand(4, 3) * mask)
    for name, entry in ESTIMATORS.items():
        rewards, advantages, returns = entry.compute(inputs, settings)
        for tensor in (rewards, advantages, returns):
            assert tensor.shape == (4, 3) and torch.isfinite(tensor).all(), name
        assert (advantages[mask == 0] == 0).all(), name
    assert ADV_ESTIMATORS == tuple(ESTIMATORS)
    assert set(GROUP_ESTIMATORS) == {n for n, e in ESTIMATORS.items() if e.group_based}
    assert [n for n, e in ESTIMATORS.items() if e.needs_critic] == ["gae"]


def test_policy_losses_come_from_one_registry():
    """The config's names are the registry's; each loss keeps its own default clip."""
    from types import SimpleNamespace

    from megatron_rlhf.algorithms.policy_losses import POLICY_LOSS_REGISTRY, POLICY_LOSSES, clip_range

    assert set(POLICY_LOSSES) == {"vanilla", "gspo", "sppo", "reinforce"} == set(POLICY_LOSS_REGISTRY)
    actor = lambda loss, **kw: SimpleNamespace(policy_loss=loss, clip_ratio=0.2, clip_ratio_low=None,  # noqa: E731
                                               clip_ratio_high=None, clip_ratio_c=3.0, sppo_eta=1.0, **kw)
    assert clip_range(actor("vanilla")) == (0.2, 0.2) and clip_range(actor("gspo")) == (3e-4, 4e-4)
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.1, -0.2, 0.0], [0.05, 0.0, 0.0]])
    mask, adv = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]), torch.tensor([[1.0, 1.0, 0.0], [-1.0, 0.0, 0.0]])
    for name, entry in POLICY_LOSS_REGISTRY.items():
        agg = "seq-mean-token-mean"
        out = entry.compute(old, new, adv, mask, actor(name), clip_range(actor(name)), agg, None, 3)
        assert out.loss.dim() == 0 and torch.isfinite(out.loss), name
