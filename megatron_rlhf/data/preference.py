"""Preference pairs from Parquet: validation, chat rendering, length policy, tokenisation.

A row has ``prompt`` (a string or a list of ``{"role", "content"}`` messages) and ``chosen`` /
``rejected`` responses (a string, or a message list that may repeat the prompt's messages first).
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field

from megatron_rlhf.data.chat import as_messages, render_prompt, split_prompt_response
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
    identical: int = 0
    """Pairs whose two sides are the same tokens (after truncation): no preference to learn."""
    files: list[str] = field(default_factory=list)
    item: str = "pairs"

    def __str__(self) -> str:
        same = f", {self.identical} dropped as identical" if self.identical else ""
        return (f"{self.total} {self.item} from {len(self.files)} file(s); {self.truncated} truncated, "
                f"{self.dropped} dropped as over-long{same}")


def _messages(value, path: str, column: str, row: int) -> list[dict]:
    return as_messages(value, "user" if column == "prompt" else "assistant",
                       f"{path}: column {column!r} row {row}")


def _limit(prompt: list[int], response: list[int], max_prompt: int, max_response: int):
    """Keep the prompt's end (the question) and the response's start."""
    return prompt[-max_prompt:], response[:max_response]


def _margin(value, path: str, column: str, row: int) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserError(f"{path}: column {column!r} row {row}: expected a finite number, got {value!r}")
    return float(value)


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
            if sides[0] == sides[1]:
                report.identical += 1
                continue
            margin = _margin(columns[margin_column][row], path, margin_column, row) \
                if margin_column else 0.0
            pairs.append(TokenizedPair(tuple(sides[0][0] + sides[0][1]),
                                       tuple(sides[1][0] + sides[1][1]), margin))
    if not pairs:
        raise UserError(f"no usable preference pairs in {', '.join(files)} ({report})")
    return pairs, report
