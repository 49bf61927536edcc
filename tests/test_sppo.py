"""SPPO's pure functions against hand-computed values and a slow loop."""

import math

import pytest
import torch

from megatron_rlhf.algorithms import sppo


def test_preference_table_is_exactly_antisymmetric():
    scores = torch.tensor([0.3, -1.7, 2.25, 0.3, 1e-8])
    for kind in sppo.PREFERENCES:
        table = sppo.pairwise_preferences(scores, kind)
        assert torch.equal(table, 1.0 - table.T)  # bitwise, not approximately
        assert torch.equal(table.diagonal(), torch.full((5,), 0.5))
    rule = sppo.pairwise_preferences(scores, "rule")
    assert rule[0, 3] == 0.5 and rule[2, 0] == 1.0 and rule[1, 0] == 0.0
    bt = sppo.pairwise_preferences(scores, "bradley_terry")
    assert bt[2, 1].item() == pytest.approx(1 / (1 + math.exp(-3.95)))


def win_rate_loop(scores, groups, kind):
    out = []
    for i in range(len(scores)):
        others = [j for j in range(len(scores)) if j != i and groups[j] == groups[i]]
        if not others:
            out.append(0.5)
            continue
        prefs = []
        for j in others:
            d = scores[i] - scores[j]
            prefs.append(1 / (1 + math.exp(-d)) if kind == "bradley_terry" else
                         (1.0 if d > 0 else 0.5 if d == 0 else 0.0))
        out.append(sum(prefs) / len(prefs))
    return torch.tensor(out)


@pytest.mark.parametrize("kind", sppo.PREFERENCES)
def test_win_rates_match_a_loop(kind):
    generator = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 3, (11,), generator=generator).float() / 2
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4])
    got = sppo.win_rates(sppo.pairwise_preferences(scores, kind), groups)
    assert torch.allclose(got, win_rate_loop(scores.tolist(), groups.tolist(), kind), atol=1e-6)


def test_targets_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.0, 5.0])
    groups = torch.tensor([0, 0, 0, 1])
    # Rule: sample 0 beats both others (rate 1), samples 1 and 2 lose to 0 and tie (rate 1/4).
    targets = sppo.sppo_targets(scores, groups, eta=2.0, target="win_rate", preference="rule")
    assert targets.tolist() == pytest.approx([1.0, -0.5, -0.5, 0.0])
    soft = sppo.sppo_targets(scores, groups, eta=1.0, target="softmean", beta=1.0)
    mean = math.log((math.e + 2) / 3)
    assert soft.tolist() == pytest.approx([1 - mean, -mean, -mean, 0.0])
    plain = sppo.sppo_targets(scores, groups, eta=1.0, target="softmean", beta=0.0)
    assert plain.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0.0])


def test_loss_is_the_squared_gap_of_sequence_log_ratios():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.2, 0.2, 0.2]]))
    new = torch.log(torch.tensor([[0.6, 0.5, 0.9], [0.4, 0.2, 0.2]])).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    targets = torch.tensor([0.5, -0.25])
    loss = sppo.sppo_loss(old, new, targets, mask)
    first, second = math.log(1.2) - 0.5, math.log(2.0) + 0.25
    assert loss.tolist() == pytest.approx([first ** 2, second ** 2])
    loss.sum().backward()
    assert new.grad[0].tolist() == pytest.approx([2 * first, 2 * first, 0.0])
    assert new.grad[1].tolist() == pytest.approx([2 * second, 0.0, 0.0])


@pytest.mark.parametrize("scope, targets, loss", [
    ("prompt", [0.380, -0.620, 0.0, 0.0], 0.132),
    ("batch", [-1.395, -2.395, 0.605, 0.605], 2.104),  # verl's SPPO recipe
])
def test_softmean_scope_per_prompt_or_over_the_batch(scope, targets, loss):
    """Scores [1, 0, 3, 3] in two prompts of two, beta = eta = 1, new = old log-probs: the
    targets and the mean loss of each scope (verl's recipe, fed the same tensors, gives the
    batch scope's)."""
    scores, groups = torch.tensor([1.0, 0.0, 3.0, 3.0]), torch.tensor([0, 0, 1, 1])
    got = sppo.sppo_targets(scores, groups, eta=1.0, target="softmean", beta=1.0, scope=scope)
    assert got.tolist() == pytest.approx(targets, abs=5e-4)
    logprob = torch.full((4, 3), -1.0)
    mean = sppo.sppo_loss(logprob, logprob, got, torch.ones(4, 3)).mean()
    assert mean.item() == pytest.approx(loss, abs=5e-4)
