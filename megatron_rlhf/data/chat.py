"""Turning (prompt, response) pairs into token ids the same way everywhere."""

from __future__ import annotations


def render_pair(tokenizer, prompt, response) -> list[int]:
    """Token ids of ``prompt`` followed by ``response``.

    With a chat template the pair becomes a user turn and an assistant turn (``prompt`` may also be
    a list of ``{"role", "content"}`` messages); without one the two strings are concatenated.
    """
    if getattr(tokenizer, "chat_template", None):
        messages = list(prompt) if isinstance(prompt, (list, tuple)) else [
            {"role": "user", "content": prompt}]
        messages.append({"role": "assistant", "content": response})
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not isinstance(prompt, str):
        raise TypeError("a tokenizer without a chat template needs string prompts")
    return list(tokenizer(prompt + response)["input_ids"])
