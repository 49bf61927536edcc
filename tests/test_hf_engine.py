"""The hf rollout engine on its own: its log-probs are the trainer's, token for token."""

import pytest
import torch

from megatron_rlhf.rollout.base import SamplingParams
from megatron_rlhf.rollout.hf_engine import HFGenerator

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]  # left padding in the middle row


@pytest.fixture(scope="module")
def engine_and_reference(tiny_models):
    from transformers import AutoModelForCausalLM

    path = tiny_models["qwen2_policy"]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = HFGenerator(str(path), torch.float32, pad_id=0, eos_id=1)
    engine.load_weights((n, p.detach().clone()) for n, p in reference.named_parameters())
    return engine, reference


@pytest.mark.parametrize("temperature, top_k", [(0.7, 5), (0.0, 0), (1.3, -1)])
def test_logprobs_are_the_tempered_teacher_forced_ones(engine_and_reference, temperature, top_k):
    engine, reference = engine_and_reference
    stops = list(range(100, 180))  # a third of the vocabulary: most samples stop early
    params = SamplingParams(max_tokens=6, temperature=temperature, top_k=top_k, n=2,
                            stop_token_ids=stops, seed=5)
    gens = engine.generate(PROMPTS, params)
    assert [g.prompt_index for g in gens] == [0, 0, 1, 1, 2, 2]
    assert any(g.finished for g in gens) and any(len(g.tokens) < 6 for g in gens)
    for g in gens:
        prompt = PROMPTS[g.prompt_index]
        assert len(g.logprobs) == len(g.tokens) and g.finished == (g.tokens[-1] in stops)
        assert not any(t in stops for t in g.tokens[:-1])  # cut right after the first stop
        with torch.no_grad():
            logits = reference(input_ids=torch.tensor([prompt + g.tokens])).logits[0].float()
        scored = torch.log_softmax(logits / (temperature or 1.0), dim=-1)[len(prompt) - 1:-1]
        expected = scored[:len(g.tokens)].gather(-1, torch.tensor(g.tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(g.logprobs), expected, atol=1e-5), (g, expected)
