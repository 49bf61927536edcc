"""Tool calls read off the policy's own text, one parser per chat format (``rollout.tool_call_format``).

- ``hermes`` (Hermes, Qwen2.5/Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number per turn;
- ``llama3`` (Llama 3.1-3.3 JSON tool calling): a JSON object ``{"name": ..., "parameters":
  {...}}`` (``arguments`` also read), optionally after ``<|python_tag|>``, several separated by
  ``;`` or whitespace.

:func:`parse_calls` returns, in order, a :class:`Call` for each well-formed call of a known tool
whose arguments fit its schema, and a :class:`ParseError` (whose message goes back to the policy
as the tool's answer, counted as an error) for each one that is not. Text with no call gives [].
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from megatron_rlhf.agent_tools.spec import ToolSpec, argument_error
from megatron_rlhf.errors import UserError

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_LLAMA_START = re.compile(r'\{\s*"name"\s*:')


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict = field(hash=False)
    raw: str = ""


@dataclass(frozen=True)
class ParseError:
    """A call the policy tried to make that cannot run; ``name`` when it named a known tool."""

    message: str
    raw: str = ""
    name: str | None = None


def parse_calls(text: str, fmt: str, tools: list[ToolSpec]) -> list[Call | ParseError]:
    """The calls in one assistant turn's ``text``; ``fmt`` is ``hermes`` or ``llama3`` (resolve
    ``auto`` once with :func:`megatron_rlhf.agent_tools.render.resolve_format`)."""
    if fmt == "hermes":
        found = _hermes(text)
    elif fmt == "llama3":
        found = _llama3(text)
    else:
        raise ValueError(f"tool call format {fmt!r}: expected hermes or llama3")
    by_name = {tool.name: tool for tool in tools}
    return [item if isinstance(item, ParseError) else make_call(*item, by_name) for item in found]


def make_call(name, arguments, raw: str, tools: dict[str, ToolSpec]) -> Call | ParseError:
    """A :class:`Call` if ``name`` is a tool and ``arguments`` fit its schema."""
    if not isinstance(name, str) or name not in tools:
        known = ", ".join(sorted(tools)) or "none"
        return ParseError(f"unknown tool {name!r} (tools: {known})", raw)
    why = argument_error(tools[name], arguments)
    if why is not None:
        return ParseError(f"invalid arguments for {name}: {why}", raw, name)
    return Call(name, arguments, raw)


def _hermes(text: str) -> list[tuple | ParseError]:
    found: list = []
    for match in _HERMES.finditer(text):
        raw, body = match.group(0), match.group(1).strip()
        if not match.group(0).endswith("</tool_call>"):
            found.append(ParseError("<tool_call> without </tool_call>", raw))
            continue
        found.append(_name_and_arguments(body, raw, ("arguments", "parameters")))
    return found


def _llama3(text: str) -> list[tuple | ParseError]:
    text = text.replace("<|python_tag|>", "")
    decoder, found, at = json.JSONDecoder(), [], 0
    while (match := _LLAMA_START.search(text, at)) is not None:
        try:
            _, end = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError as err:
            # an object that opens like a call but does not parse: one error, then look past it
            found.append(ParseError(f"malformed JSON in tool call: {err.msg}", text[match.start():]))
            at = match.end()
            continue
        raw = text[match.start():end]
        found.append(_name_and_arguments(raw, raw, ("parameters", "arguments")))
        at = end
    return found


def _name_and_arguments(body: str, raw: str, keys: tuple[str, str]) -> tuple | ParseError:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as err:
        return ParseError(f"malformed JSON in tool call: {err.msg} at character {err.pos}", raw)
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ParseError('a tool call must be a JSON object with a "name"', raw)
    key = next((k for k in keys if k in call), None)
    arguments = call.get(key, {}) if key else {}
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ParseError(f'the "{key}" of a tool call must be a JSON object', raw, call["name"])
    return call["name"], arguments, raw


def detect_format(chat_template: str) -> str | None:
    """The call format a chat template teaches, read off its text, or None."""
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<|start_header_id|>" in chat_template and '"parameters"' in chat_template:
        return "llama3"
    return None


def choose_format(fmt: str, chat_template: str, key: str = "rollout.tool_call_format") -> str:
    """``fmt`` itself, or for ``auto`` the template's; :class:`UserError` when ``auto`` finds
    none or ``fmt`` contradicts what the template shows."""
    shown = detect_format(chat_template or "")
    if fmt == "auto":
        if shown is None:
            raise UserError(f"config: {key}=auto but the chat template shows neither the hermes "
                            "(<tool_call>) nor the llama3 (JSON with \"parameters\") call format; "
                            "set hermes or llama3")
        return shown
    if shown is not None and shown != fmt:
        raise UserError(f"config: {key}={fmt} but the chat template teaches the {shown} format: "
                        "the model would be asked for calls it was not trained to write")
    return fmt
