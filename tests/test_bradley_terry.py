"""Bradley-Terry loss against hand-computed values."""

import math

import torch

from megatron_rlhf.algorithms.bradley_terry import bradley_terry_loss, pair_metrics


def test_values_by_hand():
    chosen, rejected = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([1.0, 0.0, 1.0])
    expected = [math.log(1 + math.exp(-1.0)), math.log(2.0), math.log(1 + math.exp(2.0))]
    assert torch.allclose(bradley_terry_loss(chosen, rejected), torch.tensor(expected))


def test_margin_and_centering():
    chosen, rejected = torch.tensor([3.0]), torch.tensor([1.0])
    with_margin = bradley_terry_loss(chosen, rejected, margin=torch.tensor([2.0]))
    assert torch.allclose(with_margin, torch.tensor([math.log(2.0)]))
    centered = bradley_terry_loss(chosen, rejected, center_coef=0.01)
    assert torch.allclose(centered, torch.tensor([math.log(1 + math.exp(-2.0)) + 0.01 * 16.0]))


def test_large_gaps_are_stable():
    loss = bradley_terry_loss(torch.tensor([-200.0, 200.0]), torch.tensor([200.0, -200.0]))
    assert torch.isfinite(loss).all() and abs(loss[0].item() - 400.0) < 1e-3 and loss[1] == 0


def test_gradient_pushes_rewards_apart():
    chosen = torch.tensor([0.5], requires_grad=True)
    rejected = torch.tensor([0.5], requires_grad=True)
    bradley_terry_loss(chosen, rejected).sum().backward()
    assert chosen.grad.item() == -0.5 and rejected.grad.item() == 0.5


def test_metric_sums():
    m = pair_metrics(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 3.0]))
    assert m["correct"] == 1 and m["margin"] == 0 and m["count"] == 2 and m["chosen_sq"] == 5
