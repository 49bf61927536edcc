"""Turning prompts and responses into token ids the same way everywhere (training and scoring).

A prompt is a string (one user turn) or a list of ``{"role", "content"}`` messages; a response is
a string (one assistant turn) or a message list, which may repeat the prompt's messages first.
With a chat template the turns are rendered by it. Without one, each turn is a line, the reply
starts on a new line, and a reply ends with the end-of-sequence token: a policy fine-tuned on
such text learns to stop, and a reward model sees the ending PPO samples have.
"""

from __future__ import annotations

from megatron_rlhf.errors import UserError

ROLES = ("system", "user", "assistant", "tool")


def as_messages(value, role: str, where: str = "") -> list[dict]:
    """``value`` as a message list; :class:`UserError` naming ``where`` if it is neither form."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    ok = isinstance(value, (list, tuple)) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value)
    if not ok:
        raise UserError(f"{where}: expected a string or a list of {{role, content}} messages")
    bad = [m["role"] for m in value if m["role"] not in ROLES]
    if bad:
        raise UserError(f"{where}: unknown message role {bad[0]!r} (expected one of "
                        f"{', '.join(ROLES)})")
    if role == "user" and not any(m["role"] == "user" for m in value):
        raise UserError(f"{where}: a prompt needs a user message (has "
                        f"{', '.join(m['role'] for m in value) or 'none'})")
    # A tool message's ``name`` (which tool answered) is kept: templates may render it.
    return [{"role": m["role"], "content": m["content"],
             **({"name": m["name"]} if isinstance(m.get("name"), str) else {})} for m in value]


def _render(tokenizer, messages: list[dict], generation_prompt: bool,
            tools: list[dict] | None = None) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                             add_generation_prompt=generation_prompt)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = "\n".join(m["content"] for m in messages) + ("\n" if generation_prompt else "")
    ids = list(tokenizer(text)["input_ids"])
    if not generation_prompt and messages[-1]["role"] == "assistant" and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return ids


def render_prompt(tokenizer, prompt: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The prompt alone, ending where the assistant's reply starts; ``tools``: the schemas of
    the tools the policy may call, which the chat template shows it (``rollout.tools``)."""
    return _render(tokenizer, prompt, generation_prompt=True, tools=tools)


def split_prompt_response(tokenizer, prompt: list[dict], response: list[dict],
                          head: list[int] | None = None,
                          tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """Token ids of the prompt and of the response that follows it in the rendered pair.

    ``head``: the prompt rendered alone, if already known (both sides of a pair share it);
    ``tools``: the schemas the prompt shows (as :func:`render_prompt`).
    """
    response = _after_prompt(prompt, response)
    full = _render(tokenizer, prompt + response, generation_prompt=False, tools=tools)
    if head is None:
        head = render_prompt(tokenizer, prompt, tools)
    cut = 0
    while cut < min(len(head), len(full)) and head[cut] == full[cut]:
        cut += 1
    return full[:cut], full[cut:]


def _after_prompt(prompt: list[dict], response: list[dict]) -> list[dict]:
    """``response`` without the prompt's messages when it repeats them first (full
    conversations do)."""
    return response[len(prompt):] if response[: len(prompt)] == prompt else response


def split_conversation(tokenizer, prompt: list[dict], response: list[dict],
                       tools: list[dict] | None = None
                       ) -> tuple[list[int], list[int], list[int] | None]:
    """``(prompt ids, response ids, mask)``: the response's ids as :func:`split_prompt_response`
    gives them and, when the response has other messages than one assistant turn (tool results,
    several turns), a 0/1 ``mask`` over them: 1 on each assistant turn's tokens (its text and its
    end-of-turn token, the EOS), 0 on what the environment writes in a tool rollout (what the
    template puts after that token, tool messages, the next generation prompt). None for one assistant turn: every response token is trained.

    Each assistant turn spans from the end of the conversation before it rendered with the
    generation prompt to the end of the conversation up to it rendered closed; :class:`UserError`
    when the template's renderings are not prefixes of each other (it rewrites earlier turns)."""
    response = _after_prompt(prompt, response)
    head, tail = split_prompt_response(tokenizer, prompt, response, tools=tools)
    if [m["role"] for m in response] == ["assistant"]:
        return head, tail, None
    full, mask = head + tail, [0] * len(tail)
    for k, message in enumerate(response):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, prompt + response[:k], generation_prompt=True, tools=tools)
        upto = _render(tokenizer, prompt + response[:k + 1], generation_prompt=False, tools=tools)
        if full[:len(before)] != before or full[:len(upto)] != upto:
            raise UserError("the chat template renders a conversation's turns differently once later "
                            "turns follow: its assistant tokens cannot be told apart for the loss")
        end = _turn_end(tokenizer, upto, len(before))
        for position in range(max(len(before), len(head)), end):
            mask[position - len(head)] = 1
    return head, tail, mask


def _turn_end(tokenizer, ids: list[int], start: int) -> int:
    """Where the assistant turn that starts at ``start`` and closes ``ids`` ends: after its last
    EOS (the end-of-turn token a tool rollout stops at; Qwen's newline after it is the
    environment's), or at the end without one."""
    eos = tokenizer.eos_token_id
    ends = [i for i in range(start, len(ids)) if ids[i] == eos]
    return ends[-1] + 1 if ends else len(ids)


def render_pair(tokenizer, prompt, response) -> list[int]:
    """Token ids of ``prompt`` followed by ``response`` (either form of each)."""
    head, tail = split_prompt_response(tokenizer, as_messages(prompt, "user", "prompt"),
                                       as_messages(response, "assistant", "response"))
    return head + tail


def pad_id(tokenizer) -> int:
    """The padding id: the tokenizer's pad token, else its end-of-sequence token, else 0."""
    for value in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if value is not None:
            return value
    return 0
