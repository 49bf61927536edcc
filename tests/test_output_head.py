"""The chunked output head against full logits (one process; TP and PP in tests/dist_ppo_packing.py)."""

import pytest
import torch

from megatron_rlhf.models.output_head import OutputHead, token_logprobs_from_hidden


def reference(hidden, weight, targets, vocab_size, temperature):
    logits = (hidden @ weight.t())[:, :vocab_size] / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk", [1, 5, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_log_probs_entropy_and_gradients_equal_full_logits(chunk, temperature):
    generator = torch.Generator().manual_seed(0)
    count, width, padded, vocab = 13, 16, 40, 37  # three padding rows of the output weight
    hidden = torch.randn(count, width, generator=generator, dtype=torch.float64)
    weight = torch.randn(padded, width, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, vocab, (count,), generator=generator)
    up, ue = torch.randn(count, generator=generator), torch.randn(count, generator=generator)

    def run(fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logprob, entropy = fn(h, w)
        ((logprob * up).sum() + (entropy * ue).sum()).backward()
        return logprob.double(), entropy.double(), h.grad, w.grad

    head = lambda w: OutputHead(w, 0, vocab, None, chunk)  # noqa: E731
    ours = run(lambda h, w: token_logprobs_from_hidden(h, targets, head(w), temperature))
    want = run(lambda h, w: reference(h, w, targets, vocab, temperature))
    for got, expected, name in zip(ours, want, ("logprob", "entropy", "hidden grad", "weight grad")):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=name)
    assert not ours[3][vocab:].any()  # padding rows get no gradient


def test_entropy_only_as_a_metric_adds_no_gradient_term():
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 8, generator=generator, requires_grad=True)
    weight = torch.randn(10, 8, generator=generator, requires_grad=True)
    targets = torch.randint(0, 10, (6,), generator=generator)
    logprob, entropy = token_logprobs_from_hidden(hidden, targets, OutputHead(weight, 0, 10, None, 4))
    logprob.sum().backward()
    expected = torch.autograd.grad(reference(hidden, weight, targets, 10, 1.0)[0].sum(), hidden)[0]
    torch.testing.assert_close(hidden.grad, expected)
