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
    return [{"role": m["role"], "content": m["content"]} for m in value]


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
                          head: list[int] | None = None) -> tuple[list[int], list[int]]:
    """Token ids of the prompt and of the response that follows it in the rendered pair.

    ``head``: the prompt rendered alone, if already known (both sides of a pair share it).
    """
    if response[: len(prompt)] == prompt:  # full conversations repeat the prompt first
        response = response[len(prompt):]
    full = _render(tokenizer, prompt + response, generation_prompt=False)
    if head is None:
        head = render_prompt(tokenizer, prompt)
    cut = 0
    while cut < min(len(head), len(full)) and head[cut] == full[cut]:
        cut += 1
    return full[:cut], full[cut:]


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
