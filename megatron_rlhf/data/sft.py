"""Supervised fine-tuning samples: prompt/response Parquet -> token ids with a response-only loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rlhf.data.chat import as_messages, split_conversation
from megatron_rlhf.data.packing import pack_sequences
from megatron_rlhf.data.parquet import read_table
from megatron_rlhf.data.preference import LengthReport
from megatron_rlhf.errors import UserError

SFT_COLUMNS = ("prompt", "response")


@dataclass(frozen=True)
class SFTSample:
    """``ids`` = prompt + response tokens; the first ``prompt_tokens`` carry no loss; ``mask``
    (over ``ids``, when given) is 1 on the tokens trained on: a conversation's assistant turns,
    not its tool results (:func:`~megatron_rlhf.data.chat.split_conversation`)."""

    ids: tuple[int, ...]
    prompt_tokens: int
    mask: tuple[int, ...] | None = None

    @property
    def target_tokens(self) -> int:
        if self.mask is not None:
            return sum(self.mask[1:])  # the first token is never predicted
        return len(self.ids) - self.prompt_tokens


def load_samples(files: list[str], tokenizer, max_prompt: int, max_response: int,
                 overlong: str, tools: list[dict] | None = None) -> tuple[list[SFTSample], LengthReport]:
    """Read, check and tokenise every file; :class:`UserError` names the file, column and row.
    ``tools``: the schemas every prompt shows (``data.tools``)."""
    samples, report = [], LengthReport(files=list(files), item="samples")
    for path in files:
        table = read_table(path, SFT_COLUMNS)
        prompts, responses = (table.column(c).to_pylist() for c in SFT_COLUMNS)
        for row, (prompt, response) in enumerate(zip(prompts, responses)):
            prompt = as_messages(prompt, "user", f"{path}: column 'prompt' row {row}")
            response = as_messages(response, "assistant", f"{path}: column 'response' row {row}")
            head, tail, mask = split_conversation(tokenizer, prompt, response, tools)
            if not tail:
                raise UserError(f"{path}: column 'response' row {row}: empty response")
            report.total += 1
            over = len(head) > max_prompt or len(tail) > max_response
            if over and overlong == "drop":
                report.dropped += 1
                continue
            report.truncated += int(over)
            head, tail = head[-max_prompt:], tail[:max_response]
            if mask is not None:
                mask = tuple([0] * len(head) + mask[:max_response])
            samples.append(SFTSample(tuple(head + tail), len(head), mask))
    if not samples:
        raise UserError(f"no usable samples in {', '.join(files)} ({report})")
    return samples, report


def sft_batch(samples: list[SFTSample], capacity: int, pad_id: int, remove_padding: bool,
              loss_scale: float) -> dict:
    """Packed (or padded) rows with next-token ``targets`` and a ``loss_mask`` on response tokens.

    Position ``p`` of a sequence predicts token ``p + 1``; only predictions of response tokens
    count (of a conversation's assistant tokens, where a sample has a ``mask``). ``loss_scale`` turns the summed token loss into this rank's share of the step's mean.
    """
    packed = pack_sequences([list(s.ids) for s in samples], capacity, pad_id, remove_padding)
    targets = torch.zeros_like(packed.input_ids)
    loss_mask = torch.zeros(packed.input_ids.shape)
    for sample, (row, last) in zip(samples, packed.last_index.tolist()):
        start = last - len(sample.ids) + 1
        ids = torch.tensor(sample.ids)
        targets[row, start:last] = ids[1:]
        if sample.mask is not None:
            loss_mask[row, start:last] = torch.tensor(sample.mask[1:], dtype=loss_mask.dtype)
            continue
        # An empty prompt part: the first token has nothing to be predicted from.
        loss_mask[row, start + max(sample.prompt_tokens - 1, 0):last] = 1.0
    return {"input_ids": packed.input_ids, "attention_mask": packed.attention_mask,
            "targets": targets, "loss_mask": loss_mask, "num_tokens": packed.num_tokens,
            "count": len(samples), "loss_scale": loss_scale}
