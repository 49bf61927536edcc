"""Tool results as tokens appended after the policy's own, through the tokenizer's chat template.

A multi-turn trajectory is token in, token out: the policy's tokens are kept as generated (never
decoded and re-tokenised, the drift peers' users keep reporting), and after a turn with calls we
append exactly the tokens the chat template puts between the end of that assistant turn and the
start of the next assistant generation: the tool messages and the generation prompt. The policy's
end-of-turn token (its stop token) is its own; whatever the template writes after it (Qwen's
newline after ``<|im_end|>``) is ours to append: the turn separator peers lost at this boundary.

:func:`template_mismatch` is the check (``rollout.tool_check``, metric ``tools/template_mismatch``):
render the whole conversation with the template and count where its tokens and the trajectory's
differ.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rlhf.agent_tools.parsers import choose_format
from megatron_rlhf.agent_tools.spec import ToolSpec, tool_schemas
from megatron_rlhf.errors import UserError

_MARK = "\x00TURN\x00"  # stands for an assistant text where only the template's frame matters


def tool_messages(results) -> list[dict]:
    """Tool results (anything with ``name`` and ``text``) as chat messages, in call order."""
    return [{"role": "tool", "name": r.name, "content": r.text} for r in results]


def _render(tokenizer, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def end_of_turn(tokenizer, end_of_turn: str | None = None) -> str:
    """The text of the token that ends the policy's turn: ``end_of_turn`` or the EOS token."""
    eot = end_of_turn or tokenizer.eos_token
    if not eot:
        raise UserError("tools: the tokenizer has no EOS token to end an assistant turn with")
    return eot


def _closing(tokenizer, history: list[dict], tools: list[dict] | None, eot: str) -> tuple[str, str]:
    """``(rendering of history, what the template writes after the last assistant text beyond
    the policy's end-of-turn token)``; :class:`UserError` if it does not close the turn with it."""
    before = _render(tokenizer, history, tools, False)
    content = history[-1]["content"]
    tail = before[before.rindex(content) + len(content):]
    if not tail.startswith(eot):
        raise UserError(f"tools: the chat template closes an assistant turn with {tail[:40]!r}, not "
                        f"with the policy's end-of-turn token {eot!r}: its tokens cannot be "
                        "continued exactly (set the right stop token)")
    return before, tail[len(eot):]


def append_text(tokenizer, results, tools: list[dict] | None = None,
                history: list[dict] | None = None, eot: str | None = None) -> str:
    """The text to append after an assistant turn (its end-of-turn token included) that made
    the calls answered by ``results``: the template's rendering of the conversation with the
    tool messages and the generation prompt, minus its rendering without them.

    ``history``: the conversation so far, ending with that assistant turn (default: a stand-in;
    the chat templates we know frame a tool message the same whatever came before).
    ``tools``: the schemas the prompt was rendered with (:func:`tool_schemas`)."""
    history = history or [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
    if history[-1]["role"] != "assistant":
        raise ValueError("history must end with the assistant turn that made the calls")
    eot = end_of_turn(tokenizer, eot)
    before, separator = _closing(tokenizer, history, tools, eot)
    after = _render(tokenizer, history + tool_messages(results), tools, True)
    if not after.startswith(before):
        raise UserError("tools: the chat template renders the conversation before the tool "
                        "messages differently once they follow (it rewrites earlier turns): "
                        "appending tokens cannot reproduce it. First difference at character "
                        f"{_first_difference(before, after)}: {after[:200]!r}")
    return separator + after[len(before):]


def append_ids(tokenizer, results, tools: list[dict] | None = None,
               history: list[dict] | None = None, eot: str | None = None) -> list[int]:
    """:func:`append_text` as token ids. It starts right after a special token (the policy's
    end-of-turn), where byte-level BPE never merges across, so tokenising it on its own gives
    the ids the whole conversation's tokenisation has there (:func:`template_mismatch` checks)."""
    text = append_text(tokenizer, results, tools, history, eot)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@dataclass(frozen=True)
class TemplateCheck:
    """``mismatches``: positions where the rendered and the trajectory's ids differ, plus the
    difference of their lengths; ``first``: the first such position (None when equal)."""

    mismatches: int
    first: int | None
    rendered_tokens: int
    trajectory_tokens: int


def template_mismatch(tokenizer, prompt: list[dict], conversation: list[dict],
                      trajectory_ids: list[int], tools: list[dict] | None = None,
                      eot: str | None = None) -> TemplateCheck:
    """Compare ``trajectory_ids`` (prompt ids + every generated and appended id) with the chat
    template's tokenisation of ``prompt + conversation`` (assistant texts, decoded without their
    end-of-turn token, and tool messages). A trajectory ending in an assistant turn is compared
    up to that turn's end-of-turn token (or its text, if it was cut without one)."""
    eot = end_of_turn(tokenizer, eot)
    messages = list(prompt) + list(conversation)
    if messages[-1]["role"] == "assistant":
        text, separator = _closing(tokenizer, messages, tools, eot)
        text = text[: len(text) - len(separator)]
        eot_ids = tokenizer(eot, add_special_tokens=False)["input_ids"]
        if trajectory_ids[-len(eot_ids):] != eot_ids:  # the last turn was cut by the length limit
            text = text[: len(text) - len(eot)]
    else:
        text = _render(tokenizer, messages, tools, True)
    rendered = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    trajectory = list(trajectory_ids)
    differ = [i for i, (a, b) in enumerate(zip(rendered, trajectory)) if a != b]
    length_gap = abs(len(rendered) - len(trajectory))
    first = differ[0] if differ else (min(len(rendered), len(trajectory)) if length_gap else None)
    return TemplateCheck(len(differ) + length_gap, first, len(rendered), len(trajectory))


def check_template(tokenizer, tools: list[ToolSpec], fmt: str) -> str:
    """Start-up check that the tokenizer's chat template can carry ``tools`` in ``fmt``; the
    format to parse calls with (``auto`` resolved). :class:`UserError` naming the key when the
    template has no tool support: it ignores ``tools=`` (rendering with and without them is the
    same), cannot render a tool message, or teaches another call format."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise UserError("config: rollout.tools needs a tokenizer with a chat template (it has none)")
    if not isinstance(template, str):  # several named templates: the default one renders
        template = template.get("tool_use") or template.get("default") or ""
    user = [{"role": "user", "content": "?"}]
    schemas = tool_schemas(tools)
    if _render(tokenizer, user, schemas, True) == _render(tokenizer, user, None, True):
        raise UserError("config: rollout.tool_call_format: the chat template ignores tools= (the "
                        "prompt renders the same with and without them): the model would never "
                        "see the tools; use a tokenizer whose template supports tools")
    fmt = choose_format(fmt, template)
    probe = "\x00RESULT\x00"
    history = user + [{"role": "assistant", "content": _MARK}]
    try:
        rendered = _render(tokenizer, history + [{"role": "tool", "name": tools[0].name,
                                                  "content": probe}], schemas, True)
    except Exception as err:  # noqa: BLE001  a template's own error, reported as config
        raise UserError(f"config: rollout.tools: the chat template cannot render a tool message "
                        f"({type(err).__name__}: {err})") from None
    if probe not in rendered:
        raise UserError("config: rollout.tools: the chat template drops tool messages")
    append_text(tokenizer, [], schemas, history)  # the turn boundary is exact, or a clear error
    return fmt
