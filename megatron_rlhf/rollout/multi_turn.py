"""Multi-turn rollouts: the policy answers, a rule-based environment replies, the policy tries again.

The environment is the retry loop verifiable-reward tasks use: after a turn that ``reward.fn``
scores below 1, the user says ``rollout.retry_feedback`` and the policy answers again, up to
``rollout.max_turns`` turns. A sample is the whole exchange after the prompt: the policy's tokens
(trained on, ``mask`` 1) and the environment's (``mask`` 0), with each turn's reward on that
turn's last token (:func:`megatron_rlhf.algorithms.advantages.turn_rewards`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from megatron_rlhf.rollout.base import Generation, SamplingParams


def feedback_tokens(tokenizer, feedback: str, stop_id: int) -> list[int]:
    """Tokens between the end of an assistant turn (its stop token included) and the start of
    the next assistant turn: the chat template's user turn carrying ``feedback``."""
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer(f"\n{feedback}\n", add_special_tokens=False)["input_ids"])
    marker = "\x00MARK\x00"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker},
         {"role": "user", "content": feedback}], tokenize=False, add_generation_prompt=True)
    tail = text[text.index(marker) + len(marker):]
    stop = tokenizer.decode([stop_id])
    if tail.startswith(stop):  # the policy's own stop token already closed its turn
        tail = tail[len(stop):]
    return list(tokenizer(tail, add_special_tokens=False)["input_ids"])


def run_turns(generate: Callable[[list[list[int]], SamplingParams], list[Generation]],
              prompts: list[list[int]], params: SamplingParams,
              score: Callable[[int, list[int]], float] | None, max_turns: int, feedback: list[int],
              score_many: Callable[[list[tuple[int, list[int]]]], list[float]] | None = None
              ) -> list[Generation]:
    """``params.n`` multi-turn samples per prompt, prompt-major like ``generate``.

    ``generate``: the engines' batched generation; ``score(prompt_index, turn_tokens)`` the
    rule-based reward of one turn, or ``score_many([(prompt_index, turn_tokens), ...])`` the
    rewards of a whole round of turns at once (so a reward pool scores them in parallel).
    """
    if score_many is None:
        score_many = lambda items: [score(i, tokens) for i, tokens in items]  # noqa: E731
    samples = generate(prompts, params)
    first = score_many([(g.prompt_index, g.tokens) for g in samples])
    samples = [replace(g, mask=[1] * len(g.tokens), turn_ends=[len(g.tokens) - 1], turn_scores=[s])
               for g, s in zip(samples, first)]
    for turn in range(1, max_turns):
        retry = [i for i, s in enumerate(samples) if s.finished and s.turn_scores[-1] < 1.0]
        if not retry:
            break
        contexts = [list(prompts[samples[i].prompt_index]) + samples[i].tokens + feedback for i in retry]
        answers = generate(contexts, replace(params, n=1, seed=params.seed + 7919 * turn))
        scores = score_many([(samples[i].prompt_index, a.tokens) for i, a in zip(retry, answers)])
        for i, answer, answer_score in zip(retry, answers, scores):
            s = samples[i]
            tokens = s.tokens + feedback + answer.tokens
            samples[i] = replace(
                s, tokens=tokens, logprobs=s.logprobs + [0.0] * len(feedback) + answer.logprobs,
                finished=answer.finished, mask=s.mask + [0] * len(feedback) + [1] * len(answer.tokens),
                turn_ends=s.turn_ends + [len(tokens) - 1], turn_scores=s.turn_scores + [answer_score],
                # The answer's engine read the whole context again: its routing covers it all.
                routing=answer.routing)
    return samples
