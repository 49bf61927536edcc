"""Tools as configuration: ``rollout.tools`` (and ``rollout.tools_file``) resolved into
:class:`ToolSpec` and checked at start-up.

A tool is a built-in (``python``: code run in the sandbox; ``calculator``: arithmetic) or a user
function ``package.module:function`` (resolved as ``reward.fn`` is), called with the call's
arguments as keywords, plus ``row=`` (the sample's row: prompt, ground truth, other columns)
when it has a parameter of that name, returning text. ``parameters`` is the JSON schema of the
arguments; it reaches the model through the chat template's ``tools=``.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from megatron_rlhf.errors import UserError
from megatron_rlhf.rewards.registry import import_function

FORMATS = ("auto", "hermes", "llama3")
SANDBOX_MODES = ("require", "best_effort")
ENTRY_KEYS = ("name", "fn", "description", "parameters", "timeout_s", "max_response_tokens")

BUILTINS: dict[str, tuple[str, dict]] = {
    "python": ("Run Python 3 code in a sandbox without network or files; what it prints (stdout "
               "and stderr) is the result.",
               {"type": "object",
                "properties": {"code": {"type": "string", "description": "Python source code"}},
                "required": ["code"], "additionalProperties": False}),
    "calculator": ("Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
                   {"type": "object",
                    "properties": {"expression": {"type": "string",
                                                  "description": "e.g. (3 + 4) * 2 ** 10"}},
                    "required": ["expression"], "additionalProperties": False}),
}


@dataclass(frozen=True)
class ToolSpec:
    """One resolved tool. ``fn`` is the configured spec (a built-in's name or
    ``module:function``); ``key`` names its config entry in error messages."""

    name: str
    fn: str
    description: str
    parameters: dict = field(hash=False)
    timeout_s: float = 10.0
    max_response_tokens: int = 256
    key: str = "rollout.tools"

    @property
    def builtin(self) -> bool:
        return self.fn in BUILTINS

    def schema(self) -> dict:
        """The entry for the chat template's ``tools=`` (OpenAI's function format, which the
        Hugging Face templates read)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def tool_schemas(tools: list[ToolSpec]) -> list[dict]:
    return [tool.schema() for tool in tools]


def load_tools(tools: list, tools_file: str | None = None, key: str = "rollout.tools") -> list[ToolSpec]:
    """``rollout.tools`` (dataclasses or dicts; ``key``: the config key they came from) then the
    entries of ``tools_file``, each checked: names unique, functions import, schemas are JSON
    schemas of an object, limits positive. Raises :class:`UserError` naming the key."""
    entries = [(f"{key}[{i}]", _as_dict(entry, f"{key}[{i}]"))
               for i, entry in enumerate(tools)]
    if tools_file:
        entries += [(f"rollout.tools_file ({tools_file}) [{i}]", entry)
                    for i, entry in enumerate(_read_tools_file(tools_file))]
    specs, seen = [], {}
    for key, entry in entries:
        spec = _spec(entry, key)
        if spec.name in seen:
            raise UserError(f"config: {key}.name={spec.name!r} is used twice (also {seen[spec.name]})")
        seen[spec.name] = key
        specs.append(spec)
    return specs


def _as_dict(entry, key: str) -> dict:
    if dataclasses.is_dataclass(entry):
        return dataclasses.asdict(entry)
    if not isinstance(entry, dict):
        raise UserError(f"config: {key} must be a mapping of {', '.join(ENTRY_KEYS)}")
    return dict(entry)


def _read_tools_file(path: str) -> list[dict]:
    import yaml

    if not Path(path).is_file():
        raise UserError(f"config: rollout.tools_file={path!r}: no such file")
    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as err:
        raise UserError(f"config: rollout.tools_file={path!r} is not valid YAML "
                        f"({' '.join(str(err).split())})") from None
    if isinstance(loaded, dict) and "tools" in loaded:  # also accept a file with a `tools:` key
        loaded = loaded["tools"]
    if not isinstance(loaded, list):
        raise UserError(f"config: rollout.tools_file={path!r} must hold a list of tools")
    return [_as_dict(entry, f"rollout.tools_file ({path}) [{i}]") for i, entry in enumerate(loaded)]


def _spec(entry: dict, key: str) -> ToolSpec:
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if unknown:
        raise UserError(f"config: {key}.{unknown[0]}: unknown key (a tool has {', '.join(ENTRY_KEYS)})")
    name = entry.get("name")
    if not isinstance(name, str) or not name.strip() or name == "???":
        raise UserError(f"config: {key}.name={name!r} must be a non-empty string")
    fn = entry.get("fn") or name  # `{name: python}` is the built-in of that name
    description, parameters = entry.get("description") or "", entry.get("parameters") or {}
    if fn in BUILTINS:
        default_description, default_parameters = BUILTINS[fn]
        description, parameters = description or default_description, parameters or default_parameters
    else:
        resolve_function(fn, f"{key}.fn")
        if not parameters:
            raise UserError(f"config: {key}.parameters is empty: a user function needs the JSON "
                            "schema of its arguments")
    check_schema(parameters, f"{key}.parameters")
    timeout_s = entry.get("timeout_s", 10.0)
    max_tokens = entry.get("max_response_tokens", 256)
    if not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) or timeout_s <= 0:
        raise UserError(f"config: {key}.timeout_s={timeout_s!r} must be a positive number")
    if not isinstance(max_tokens, int) or max_tokens <= 0:
        raise UserError(f"config: {key}.max_response_tokens={max_tokens!r} must be a positive integer")
    return ToolSpec(name, fn, description, _plain(parameters), float(timeout_s), max_tokens, key)


def _plain(value):
    """OmegaConf containers (and tuples) as plain dicts and lists, so schemas compare, pickle
    and serialise as JSON."""
    if isinstance(value, dict) or hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def resolve_function(spec: str, key: str) -> tuple[Callable, bool]:
    """A user tool's function and whether it takes ``row``."""
    fn = import_function(spec, key)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # some C functions have no signature: arguments only
        return fn, False
    return fn, "row" in params


def check_schema(schema, key: str) -> None:
    """A JSON schema (checked by ``jsonschema`` against its metaschema) of an object."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    schema = _plain(schema)
    if not isinstance(schema, dict):
        raise UserError(f"config: {key} must be a JSON schema (a mapping), not {type(schema).__name__}")
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as err:
        where = "/".join(map(str, err.path)) or "top level"
        raise UserError(f"config: {key} is not a JSON schema ({where}: {err.message})") from None
    if schema.get("type") != "object":
        raise UserError(f"config: {key} must describe an object (type: object), the call's "
                        f"keyword arguments; got type {schema.get('type')!r}")


def argument_error(tool: ToolSpec, arguments: Any) -> str | None:
    """Why ``arguments`` do not fit ``tool``'s schema (one line), or None."""
    from jsonschema import Draft202012Validator

    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, not {type(arguments).__name__}"
    errors = sorted(Draft202012Validator(tool.parameters).iter_errors(arguments),
                    key=lambda e: list(e.path))
    if not errors:
        return None
    where = "/".join(map(str, errors[0].path))
    return f"{where + ': ' if where else ''}{errors[0].message}"


def check_tool_settings(rollout) -> list[ToolSpec]:
    """The start-up check of ``rollout``'s tool keys (no tokenizer needed); the tools."""
    if rollout.tool_call_format not in FORMATS:
        raise UserError(f"config: rollout.tool_call_format={rollout.tool_call_format!r} must be one "
                        f"of {', '.join(FORMATS)}")
    if rollout.sandbox not in SANDBOX_MODES:
        raise UserError(f"config: rollout.sandbox={rollout.sandbox!r} must be one of "
                        f"{', '.join(SANDBOX_MODES)}")
    for name in ("max_assistant_turns", "tool_workers"):
        if getattr(rollout, name) < 1:
            raise UserError(f"config: rollout.{name}={getattr(rollout, name)} must be >= 1")
    return load_tools(rollout.tools, rollout.tools_file)
