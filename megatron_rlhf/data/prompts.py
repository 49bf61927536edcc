"""PPO prompts: Parquet with a prompt column (string or chat messages) and, for rule-based
rewards, a ground-truth column; any other columns travel with each prompt as ``extra`` (what a
reward function receives). Rendered with the chat template up to the assistant's turn."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from megatron_rlhf.data.chat import as_messages, render_prompt
from megatron_rlhf.data.parquet import read_table
from megatron_rlhf.data.preference import LengthReport
from megatron_rlhf.errors import UserError


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    ground_truth: str | None
    text: str = ""
    """The prompt as text (for chat messages, the last user message's content)."""
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    """The row's other columns (neither prompt nor ground truth), by name."""
    messages: tuple = field(default=(), compare=False, hash=False)
    """The prompt as chat messages (what a tool rollout's check mode renders again)."""


def load_prompts(files: list[str], tokenizer, prompt_key: str, ground_truth_key: str,
                 max_prompt: int, overlong: str, need_ground_truth: bool,
                 check_truth: Callable[[str], object] | None = None,
                 tools: list[dict] | None = None) -> tuple[list[Prompt], LengthReport]:
    """Read, check and tokenise every file; :class:`UserError` names the file, column and row.

    Ground truths may be strings or numbers; ``check_truth(truth)`` (a built-in reward's reader,
    see ``RewardScorer.check_ground_truth``) must accept each one, so a value the reward cannot
    read stops the run here rather than mid-training. ``tools``: tool schemas the chat template
    renders into every prompt (``rollout.tools``).
    """
    prompts, report = [], LengthReport(files=list(files), item="prompts")
    for path in files:
        table = read_table(path, (prompt_key,))
        if need_ground_truth and ground_truth_key not in table.column_names:
            raise UserError(f"{path}: missing column {ground_truth_key!r} (has "
                            f"{', '.join(table.column_names)})")
        texts = table.column(prompt_key).to_pylist()
        truths = (table.column(ground_truth_key).to_pylist()
                  if ground_truth_key in table.column_names else [None] * len(texts))
        others = {name: table.column(name).to_pylist() for name in table.column_names
                  if name not in (prompt_key, ground_truth_key)}
        for row, (text, truth) in enumerate(zip(texts, truths)):
            where = f"{path}: column {prompt_key!r} row {row}"
            messages = as_messages(text, "user", where)
            ids = render_prompt(tokenizer, messages, tools)
            content = next(m["content"] for m in reversed(messages) if m["role"] == "user")
            extra = {name: values[row] for name, values in others.items()}
            if need_ground_truth and (truth is None or str(truth).strip() == ""):
                raise UserError(f"{path}: column {ground_truth_key!r} row {row} is empty")
            if need_ground_truth and check_truth is not None:
                try:
                    check_truth(str(truth))
                except Exception as err:  # a user's checker may raise anything
                    raise UserError(f"{path}: column {ground_truth_key!r} row {row}: the reward "
                                    f"function cannot check {truth!r} ({type(err).__name__}: "
                                    f"{err})") from None
            report.total += 1
            if len(ids) > max_prompt:
                if overlong == "drop":
                    report.dropped += 1
                    continue
                ids, report.truncated = ids[-max_prompt:], report.truncated + 1
            prompts.append(Prompt(tuple(ids), None if truth is None else str(truth), content, extra,
                                  tuple(messages)))
    if not prompts:
        raise UserError(f"no usable prompts in {', '.join(files)} ({report})")
    return prompts, report
