"""Preference pairs from Parquet: validation, chat rendering, length policy, tokenisation.

A row has ``prompt`` (a string or a list of ``{"role", "content"}`` messages) and ``chosen`` /
``rejected`` responses (a string, or a message list that may repeat the prompt's messages first).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rlhf.data.parquet import read_table
from megatron_rlhf.errors import UserError

PAIR_COLUMNS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class TokenizedPair:
    """One pair as token ids: ``prompt + chosen`` and ``prompt + rejected``."""

    chosen: tuple[int, ...]
    rejected: tuple[int, ...]
    margin: float = 0.0


@dataclass
class LengthReport:
    """What the length policy did, reported at start-up."""

    total: int = 0
    truncated: int = 0
    dropped: int = 0
    files: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return (f"{self.total} pairs from {len(self.files)} file(s); {self.truncated} truncated, "
                f"{self.dropped} dropped as over-long")


def _messages(value, path: str, column: str, row: int) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "assistant" if column != "prompt" else "user", "content": value}]
    ok = isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value)
    if not ok:
        raise UserError(f"{path}: column {column!r} row {row}: expected a string or a list of "
                        "{role, content} messages")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=generation_prompt)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = "".join(m["content"] for m in messages)
    return list(tokenizer(text)["input_ids"])


def split_prompt_response(tokenizer, prompt: list[dict], response: list[dict],
                          head: list[int] | None = None):
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


def render_prompt(tokenizer, prompt: list[dict]) -> list[int]:
    return _render(tokenizer, prompt, generation_prompt=bool(getattr(tokenizer, "chat_template", None)))


def _limit(prompt: list[int], response: list[int], max_prompt: int, max_response: int):
    """Keep the prompt's end (the question) and the response's start."""
    return prompt[-max_prompt:], response[:max_response]


def load_pairs(files: list[str], tokenizer, max_prompt: int, max_response: int, overlong: str,
               margin_column: str | None = None) -> tuple[list[TokenizedPair], LengthReport]:
    """Read, check and tokenise every file; :class:`UserError` names the file, column and row."""
    pairs, report = [], LengthReport(files=list(files))
    required = PAIR_COLUMNS + ((margin_column,) if margin_column else ())
    for path in files:
        table = read_table(path, PAIR_COLUMNS)
        if margin_column and margin_column not in table.column_names:
            raise UserError(f"{path}: missing margin column {margin_column!r}")
        columns = {name: table.column(name).to_pylist() for name in required}
        for row in range(table.num_rows):
            prompt = _messages(columns["prompt"][row], path, "prompt", row)
            prompt_ids = render_prompt(tokenizer, prompt)
            sides, over = [], False
            for column in ("chosen", "rejected"):
                response = _messages(columns[column][row], path, column, row)
                head, tail = split_prompt_response(tokenizer, prompt, response, prompt_ids)
                if not tail:
                    raise UserError(f"{path}: column {column!r} row {row}: empty response")
                over |= len(head) > max_prompt or len(tail) > max_response
                sides.append(_limit(head, tail, max_prompt, max_response))
            report.total += 1
            if over and overlong == "drop":
                report.dropped += 1
                continue
            report.truncated += int(over)
            margin = float(columns[margin_column][row]) if margin_column else 0.0
            pairs.append(TokenizedPair(tuple(sides[0][0] + sides[0][1]),
                                       tuple(sides[1][0] + sides[1][1]), margin))
    if not pairs:
        raise UserError(f"no usable preference pairs in {', '.join(files)} ({report})")
    return pairs, report
