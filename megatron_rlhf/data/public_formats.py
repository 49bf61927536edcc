"""Converters from common public preference layouts into ours (prompt, chosen, rejected).

* HH-RLHF: ``chosen`` / ``rejected`` are whole transcripts ("\\n\\nHuman: ...\\n\\nAssistant: ...")
  sharing every turn but the last assistant reply.
* UltraFeedback (binarized): ``chosen`` / ``rejected`` are message lists ending in the assistant
  reply; optional ``score_chosen`` / ``score_rejected`` become a ``margin`` column.

Prompts become message lists; responses become the final assistant reply's text.
"""

from __future__ import annotations

import re

_TURN = re.compile(r"\n\n(Human|Assistant): ")
_ROLES = {"Human": "user", "Assistant": "assistant"}


def parse_hh_transcript(text: str) -> list[dict]:
    """``"\\n\\nHuman: hi\\n\\nAssistant: hello"`` -> ``[{user: hi}, {assistant: hello}]``."""
    parts = _TURN.split(text)
    if len(parts) < 3 or parts[0].strip():
        raise ValueError("not an HH-RLHF transcript (expected '\\n\\nHuman: ' first)")
    return [{"role": _ROLES[parts[i]], "content": parts[i + 1].strip()}
            for i in range(1, len(parts) - 1, 2)]


def _split_last_reply(messages: list[dict]) -> tuple[list[dict], str]:
    if not messages or messages[-1]["role"] != "assistant":
        raise ValueError("the conversation does not end with an assistant reply")
    return messages[:-1], messages[-1]["content"]


def convert_pair(chosen_messages: list[dict], rejected_messages: list[dict]) -> dict:
    """One row of ours from two conversations that must differ only in the final reply."""
    prompt, chosen = _split_last_reply(chosen_messages)
    prompt_r, rejected = _split_last_reply(rejected_messages)
    if prompt != prompt_r:
        raise ValueError("chosen and rejected conversations differ before the final reply")
    if not any(m["role"] == "user" for m in prompt):
        raise ValueError("no user turn before the final reply")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def convert_rows(rows: list[dict], layout: str) -> tuple[list[dict], list[tuple[int, str]]]:
    """Convert ``rows`` of ``layout`` ("hh-rlhf" | "ultrafeedback"); returns (rows, skipped)."""
    out, skipped = [], []
    for index, row in enumerate(rows):
        try:
            if layout == "hh-rlhf":
                converted = convert_pair(parse_hh_transcript(row["chosen"]),
                                         parse_hh_transcript(row["rejected"]))
            elif layout == "ultrafeedback":
                converted = convert_pair(list(row["chosen"]), list(row["rejected"]))
                if row.get("score_chosen") is not None and row.get("score_rejected") is not None:
                    converted["margin"] = float(row["score_chosen"]) - float(row["score_rejected"])
            else:
                raise KeyError(layout)
        except (ValueError, TypeError, KeyError) as err:
            skipped.append((index, str(err)))
            continue
        out.append(converted)
    return out, skipped
