"""Multi-turn rollouts with tools (issue 37), token in and token out.

The policy generates; the calls of each turn are parsed from the text of its own tokens; all
calls of a round run at once (:meth:`ToolSession.run_round`: worker processes, each call bounded
by its timeout); each sample's results become the ids the chat template puts after that turn
(:func:`append_ids`: the tool messages and the next generation prompt), appended with ``mask`` 0
and log-prob 0; the policy continues from exactly its own tokens plus those, never from
re-tokenised text. A trajectory ends when a turn has no call, ends otherwise than with the
end-of-turn token (a ``rollout.stop`` string, or the length limit), reaches
``rollout.max_assistant_turns``, or when the appended ids would leave no room in the response
budget (``params.max_tokens`` for the whole trajectory, tool tokens included): then its last turn's
calls stay unanswered and it counts as cut (``finished`` False).

A sample is a :class:`Generation` as :func:`megatron_rlhf.rollout.multi_turn.run_turns` makes
them (``mask``, ``turn_ends``), so experience, losses and advantages, which honour the mask,
train on the policy's tokens only and put the trajectory's reward on its last policy token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from megatron_rlhf.agent_tools.executor import ToolResult, ToolSession, tool_metrics
from megatron_rlhf.agent_tools.parsers import parse_calls
from megatron_rlhf.agent_tools.render import (append_ids, check_template, end_of_turn,
                                              template_mismatch, tool_messages)
from megatron_rlhf.agent_tools.spec import ToolSpec, check_tool_settings, tool_schemas
from megatron_rlhf.rollout.base import Generation, SamplingParams

Generate = Callable[[list[list[int]], SamplingParams], list[Generation]]


@dataclass
class ToolEnv:
    """A run's tools, ready for rollouts (built once at start-up by :func:`make_tool_env`)."""

    session: ToolSession
    tools: list[ToolSpec]
    fmt: str  # the call format, ``auto`` resolved
    tokenizer: object
    max_turns: int  # rollout.max_assistant_turns
    check: bool = False  # rollout.tool_check

    @property
    def schemas(self) -> list[dict]:
        """What the prompts were rendered with (``tools=``): the appended ids must match."""
        return tool_schemas(self.tools)

    @property
    def eot_id(self) -> int:
        """The token that ends an assistant turn (the tokenizer's EOS): only a turn ending with
        it is continued, because the template's frame after a turn starts right after it."""
        eot = end_of_turn(self.tokenizer)
        return self.tokenizer.convert_tokens_to_ids(eot)

    def close(self) -> None:
        self.session.close()


def make_tool_env(rollout, tokenizer) -> ToolEnv | None:
    """``rollout.tools`` checked against the tokenizer's chat template and started (workers,
    sandbox probe), or None without tools. Problems are :class:`UserError` here, at start-up."""
    tools = check_tool_settings(rollout)
    if not tools:
        return None
    fmt = check_template(tokenizer, tools, rollout.tool_call_format)
    session = ToolSession(tools, tokenizer, rollout.tool_workers, rollout.sandbox)
    return ToolEnv(session, tools, fmt, tokenizer, rollout.max_assistant_turns, rollout.tool_check)


@dataclass
class _Trajectory:
    """One sample being rolled out: its :class:`Generation` so far, its conversation (for the
    check mode) and the calls of its last turn (empty: it ended without one, or not with the
    end-of-turn token)."""

    gen: Generation
    conversation: list[dict]  # assistant texts (without their end-of-turn) and tool messages
    calls: list
    unanswered: int = 0  # calls a limit left unanswered (the turn limit or the budget)


def run_tool_turns(generate: Generate, prompts: list[list[int]], params: SamplingParams,
                   env: ToolEnv, rows: list[dict] | None = None,
                   messages: list[list[dict]] | None = None) -> tuple[list[Generation], dict]:
    """``params.n`` tool-using trajectories per prompt, prompt-major like ``generate``, and their
    ``tools/*`` metrics.

    ``generate``: the engines' batched generation (token ids in, :class:`Generation` out);
    ``rows[i]``: prompt ``i``'s row for user functions taking ``row``; ``messages[i]``: prompt
    ``i`` as chat messages (the check mode, ``env.check``, renders the whole conversation from
    them).
    """
    samples = [_start(env, g) for g in generate(prompts, params)]
    results: list[ToolResult] = []
    for turn in range(1, env.max_turns):
        calling = [t for t in samples if t.calls]
        if not calling:
            break
        answered = env.session.run_round(
            [c for t in calling for c in t.calls],
            [rows[t.gen.prompt_index] if rows else {} for t in calling for _ in t.calls])
        results += answered
        going = []
        for t in calling:
            mine, answered = answered[:len(t.calls)], answered[len(t.calls):]
            ids = append_ids(env.tokenizer, mine, env.schemas)
            left = params.max_tokens - len(t.gen.tokens) - len(ids)
            if left < 1:  # no room for another turn: the results are never shown
                t.unanswered, t.calls, t.gen.finished = len(t.calls), [], False
                continue
            t.conversation += tool_messages(mine)
            going.append((t, ids, left))
        if not going:
            break
        contexts = [list(prompts[t.gen.prompt_index]) + t.gen.tokens + ids for t, ids, _ in going]
        # One batch for all: each reply is then cut to its own trajectory's budget (a prefix of
        # a sample is the sample a smaller max_tokens would have drawn).
        replies = generate(contexts, replace(params, n=1, max_tokens=max(x[2] for x in going),
                                             seed=params.seed + 7919 * turn))
        for (t, ids, left), context, reply in zip(going, contexts, replies):
            _extend(env, t, ids, _cut(reply, left, len(context)))
    for t in samples:  # the turn limit: the last turn's calls stay unanswered
        t.unanswered += len(t.calls)
    metrics = trajectory_metrics([t.gen for t in samples], results,
                                 sum(t.unanswered for t in samples))
    if env.check and messages is not None:
        metrics["tools/template_mismatch"] = float(sum(
            _mismatch(env, t, prompts, messages) > 0 for t in samples))
    return [replace(t.gen, messages=t.conversation) for t in samples], metrics


def _turn(env: ToolEnv, tokens: list[int]) -> tuple[dict, list]:
    """An assistant turn's message (its text without the end-of-turn token) and its calls (none
    unless the end-of-turn token closed it)."""
    closed = bool(tokens) and tokens[-1] == env.eot_id
    # Special tokens stay in the text: some formats' call markers are special (<|python_tag|>).
    text = env.tokenizer.decode(tokens[:-1] if closed else tokens, skip_special_tokens=False)
    calls = parse_calls(text, env.fmt, env.tools) if closed else []
    return {"role": "assistant", "content": text}, calls


def _start(env: ToolEnv, g: Generation) -> _Trajectory:
    message, calls = _turn(env, g.tokens)
    return _Trajectory(replace(g, mask=[1] * len(g.tokens), turn_ends=[len(g.tokens) - 1]),
                       [message], calls)


def _extend(env: ToolEnv, t: _Trajectory, ids: list[int], reply: Generation) -> None:
    """``ids`` (the environment's: mask 0, log-prob 0) and the policy's ``reply`` after ``t``."""
    g = t.gen
    tokens = g.tokens + ids + reply.tokens
    t.gen = replace(g, tokens=tokens, logprobs=g.logprobs + [0.0] * len(ids) + reply.logprobs,
                    finished=reply.finished, mask=g.mask + [0] * len(ids) + [1] * len(reply.tokens),
                    turn_ends=g.turn_ends + [len(tokens) - 1],
                    # The reply's engine read the whole context again: its routing covers it all.
                    routing=reply.routing)
    message, t.calls = _turn(env, reply.tokens)
    t.conversation.append(message)


def _cut(reply: Generation, left: int, context: int) -> Generation:
    """``reply`` cut to ``left`` tokens (``context``: the ids it continued)."""
    if len(reply.tokens) <= left:
        return reply
    routing = reply.routing[:context + left - 1] if reply.routing is not None else None
    return replace(reply, tokens=reply.tokens[:left], logprobs=reply.logprobs[:left],
                   finished=False, routing=routing)


def trajectory_metrics(gens: list[Generation], results: list[ToolResult],
                       unanswered: int) -> dict[str, float]:
    """``tools/{calls,errors,timeouts,truncated}`` (and per tool name: ``tools/<name>/calls``,
    ...), ``tools/calls_per_sample``, ``tools/turns_mean`` (assistant turns per sample) and
    ``tools/unanswered`` (calls a limit left without an answer)."""
    out = {f"tools/{k}": 0.0 for k in ("calls", "errors", "timeouts", "truncated")}
    out |= tool_metrics(results)
    out["tools/calls_per_sample"] = out["tools/calls"] / max(len(gens), 1)
    out["tools/turns_mean"] = sum(len(g.turn_ends) for g in gens) / max(len(gens), 1)
    out["tools/unanswered"] = float(unanswered)
    return out


def _mismatch(env: ToolEnv, t: _Trajectory, prompts: list[list[int]],
              messages: list[list[dict]]) -> int:
    """Positions where the trajectory and the template's tokenisation of its conversation differ."""
    index = t.gen.prompt_index
    return template_mismatch(env.tokenizer, messages[index], t.conversation,
                             list(prompts[index]) + t.gen.tokens, env.schemas).mismatches
