"""Offline responses for PPO/GRPO (``data.offline_files``): samples read from Parquet instead of
generated, so existing data (earlier rollouts, another model's answers, a preference set's
chosen and rejected replies) trains the policy without new rollouts.

Two layouts are read:

* ``prompt``, ``response`` (a string), and optionally ``behaviour_logprobs`` (one float per
  response token, as the chat template tokenises it: the log-probs of the policy that wrote it)
  and the ground-truth column;
* ``prompt``, ``chosen``, ``rejected`` (the preference format; both replies become samples).

Samples whose prompts render to the same tokens form one group, so group baselines compare them.
Responses are tokenised as the chat template renders an assistant turn (its end-of-turn token
included), the way the policy itself would have produced them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_rlhf.data.chat import as_messages, render_prompt, split_prompt_response
from megatron_rlhf.data.parquet import read_table
from megatron_rlhf.data.prompts import Prompt
from megatron_rlhf.errors import UserError


@dataclass
class OfflineSample:
    tokens: list[int]
    logprobs: list[float] | None
    """The behaviour policy's log-probs of ``tokens``; ``None``: not in the file (the run computes
    them once with its starting policy)."""


@dataclass
class OfflineGroup:
    prompt: Prompt
    samples: list[OfflineSample]


def _responses(table, path: str) -> tuple[list[list[str]], list | None]:
    """Per row, its replies (one, or chosen and rejected) and the behaviour log-probs column."""
    names = table.column_names
    if "response" in names:
        replies = [[r] for r in table.column("response").to_pylist()]
        logprobs = (table.column("behaviour_logprobs").to_pylist()
                    if "behaviour_logprobs" in names else None)
        return replies, logprobs
    if "chosen" in names and "rejected" in names:
        chosen, rejected = table.column("chosen").to_pylist(), table.column("rejected").to_pylist()
        return [[c, r] for c, r in zip(chosen, rejected)], None
    raise UserError(f"{path}: offline responses need a 'response' column, or 'chosen' and "
                    f"'rejected' (has {', '.join(names)})")


def _check_logprobs(values, count: int, where: str) -> list[float]:
    if not isinstance(values, (list, tuple)) or len(values) != count:
        got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise UserError(f"{where}: behaviour_logprobs has {got} values for {count} response "
                        "tokens (one per token, as the chat template tokenises the reply)")
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v <= 0 for v in values):
        raise UserError(f"{where}: behaviour_logprobs must be finite log-probabilities (<= 0)")
    return [float(v) for v in values]


def load_offline(files: list[str], tokenizer, prompt_key: str, ground_truth_key: str,
                 max_prompt: int, max_response: int,
                 need_ground_truth: bool) -> tuple[list[OfflineGroup], dict[str, int]]:
    """Read every file into groups of samples; :class:`UserError` names the file, column and row
    of anything unusable. Prompts or responses over their budgets are dropped and counted."""
    groups: dict[tuple[int, ...], OfflineGroup] = {}
    report = {"rows": 0, "samples": 0, "dropped": 0}
    for path in files:
        table = read_table(path, (prompt_key,))
        if need_ground_truth and ground_truth_key not in table.column_names:
            raise UserError(f"{path}: missing column {ground_truth_key!r} (has "
                            f"{', '.join(table.column_names)})")
        replies, logprobs = _responses(table, path)
        truths = (table.column(ground_truth_key).to_pylist()
                  if ground_truth_key in table.column_names else [None] * table.num_rows)
        for row, (prompt, texts) in enumerate(zip(table.column(prompt_key).to_pylist(), replies)):
            where = f"{path}: row {row}"
            messages = as_messages(prompt, "user", f"{path}: column {prompt_key!r} row {row}")
            head = render_prompt(tokenizer, messages)
            report["rows"] += 1
            for text in texts:
                if not isinstance(text, str) or not text.strip():
                    raise UserError(f"{where}: the response is {type(text).__name__} "
                                    f"{text!r}, not a non-empty string")
                _, tokens = split_prompt_response(tokenizer, messages,
                                                  [{"role": "assistant", "content": text}], head)
                if len(head) > max_prompt or len(tokens) > max_response:
                    report["dropped"] += 1
                    continue
                given = None if logprobs is None else _check_logprobs(logprobs[row], len(tokens),
                                                                     where)
                truth = None if truths[row] is None else str(truths[row])
                content = messages[-1]["content"]
                group = groups.setdefault(tuple(head), OfflineGroup(
                    Prompt(tuple(head), truth, content, {}), []))
                group.samples.append(OfflineSample(list(tokens), given))
                report["samples"] += 1
    if not groups:
        raise UserError(f"no usable offline responses in {', '.join(files)} ({report})")
    return list(groups.values()), report
