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


def test_without_logprobs_the_same_samples_and_no_log_softmax(engine_and_reference, monkeypatch):
    engine, _ = engine_and_reference
    params = SamplingParams(max_tokens=6, temperature=0.9, n=2, seed=11)
    with_logprobs = engine.generate(PROMPTS, params)
    calls = []
    real = torch.log_softmax
    monkeypatch.setattr(torch, "log_softmax", lambda *a, **k: calls.append(1) or real(*a, **k))
    without = engine.generate(PROMPTS, SamplingParams(**{**params.__dict__, "logprobs": False}))
    assert [g.tokens for g in without] == [g.tokens for g in with_logprobs]
    assert all(g.logprobs == [] for g in without) and not calls
    engine.generate(PROMPTS, params)
    assert calls  # the recorder's log_softmax is what the flag skips


def _teacher_forced(model, batch, temperature):
    """``log p(target)`` of every position of ``batch`` under ``model`` (the target grid)."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits.float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, batch["targets"][..., None])[..., 0]


def test_rollout_correction_on_a_perturbed_engine(engine_and_reference, tiny_models):
    """Noise added to the engine's weights after the sync: the driver's correction weights and
    masks are those of the perturbed model's own probabilities, computed apart."""
    import copy
    from types import SimpleNamespace

    from megatron_rlhf.config.ppo_schema import PPOConfig
    from megatron_rlhf.trainers.rl.agent import PPORun
    from megatron_rlhf.trainers.rl.experience import build_batch

    _, reference = engine_and_reference
    perturbed = copy.deepcopy(reference)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for param in perturbed.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    engine = HFGenerator(str(tiny_models["qwen2_policy"]), torch.float32, pad_id=0, eos_id=1)
    engine.load_weights((n, p.detach().clone()) for n, p in perturbed.named_parameters())
    gens = engine.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=1.0, n=4, seed=3))
    batch = build_batch([tuple(p) for p in PROMPTS], gens, pad_id=0)
    mask = batch["loss_mask"]
    old = _teacher_forced(reference, batch, 1.0) * mask  # the trainer's (unperturbed) policy
    rollout = _teacher_forced(perturbed, batch, 1.0) * mask  # what the engine sampled from

    cfg = PPOConfig()
    cfg.algorithm.rollout_correction.mode = "tis+mask"
    cfg.algorithm.rollout_correction.tis_cap = 1.5
    cfg.algorithm.rollout_correction.mask_low, cfg.algorithm.rollout_correction.mask_high = 0.9, 1.1
    actor = SimpleNamespace(call=lambda *args: [(0, (old, None, None, None))])
    run = SimpleNamespace(cfg=cfg, actor=actor)
    run.correct = lambda *args: PPORun.correct(run, *args)
    metrics = PPORun.log_probs(run, batch, gens)

    ratio = torch.exp(old - rollout)
    expected_weights = ratio.clamp(max=1.5) * mask
    assert torch.allclose(batch["is_weights"], expected_weights, atol=1e-5)
    geometric = torch.exp(((old - rollout) * mask).sum(1) / mask.sum(1))
    expected_keep = (geometric >= 0.9) & (geometric <= 1.1)
    assert batch["train_rows"].tolist() == expected_keep.tolist()
    # The perturbation is visible and both corrections act on this batch.
    assert metrics["rollout/logprob_diff_max"] > 0.05
    assert 0 < metrics["rollout/is_capped_fraction"] < 1
    assert 0 < metrics["rollout/masked_fraction"] < 1
    assert metrics["rollout/masked_fraction"] == pytest.approx(1 - expected_keep.float().mean().item())


def test_memory_tags_follow_sglangs_order(tiny_models, engine_and_reference):
    """weights back, the sync, kv_cache back, generate: generating with either tag released is
    an error, and each tag frees and restores only its own memory."""
    _, reference = engine_and_reference
    engine = HFGenerator(str(tiny_models["qwen2_policy"]), torch.float32, pad_id=0, eos_id=1)
    weights = lambda: ((n, p.detach().clone()) for n, p in reference.named_parameters())  # noqa: E731
    engine.load_weights(weights())
    params = SamplingParams(max_tokens=4, temperature=0.0)
    expected, full = engine.generate(PROMPTS, params), engine.resident_bytes()
    engine.release_memory()
    assert engine.resident_bytes() == 0
    with pytest.raises(RuntimeError, match="weights and kv_cache resumed"):
        engine.generate(PROMPTS, params)
    engine.resume_memory(["weights"])
    assert engine.resident_bytes() == full
    engine.load_weights(weights())
    with pytest.raises(RuntimeError, match=r"\['kv_cache'\] released"):
        engine.generate(PROMPTS, params)
    engine.resume_memory(["kv_cache"])
    assert engine.generate(PROMPTS, params) == expected
    engine.release_memory(["kv_cache"])
    assert engine.resident_bytes() == full  # the weights stay
    with pytest.raises(RuntimeError, match="kv_cache"):
        engine.generate(PROMPTS, params)
    with pytest.raises(ValueError, match="cuda_graph"):
        engine.release_memory(["cuda_graph"])


def test_a_prompt_sampled_n_times_is_prefilled_once(family_models):
    """rollout.n samples of a prompt: its KV cache (all but its last token) is computed once and
    repeated for each sample. The same samples, log-probs and MoE routing (Qwen3-MoE, greedy
    and sampled) as prefilling every copy, with fewer tokens through the model."""
    from transformers import AutoModelForCausalLM

    path = family_models["qwen3_moe"]
    engine = HFGenerator(str(path), torch.float32, pad_id=0, eos_id=1)
    engine.load_weights(AutoModelForCausalLM.from_pretrained(path).state_dict().items())
    seen = []
    hook = engine.model.register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append(int(kwargs["input_ids"].numel())), with_kwargs=True)
    try:
        for temperature in (0.0, 1.0):
            params = SamplingParams(max_tokens=6, temperature=temperature, n=4, seed=5,
                                    routed_experts=True)
            runs = {}
            for share in (False, True):
                engine.share_prefill, seen[:] = share, []
                runs[share] = (engine.generate(PROMPTS, params), sum(seen))
            (copies, copies_tokens), (shared, shared_tokens) = runs[False], runs[True]
            assert shared_tokens < copies_tokens
            for a, b in zip(copies, shared):
                assert a.tokens == b.tokens and a.prompt_index == b.prompt_index
                assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
                assert torch.equal(a.routing, b.routing)
    finally:
        hook.remove()
        engine.share_prefill = True
