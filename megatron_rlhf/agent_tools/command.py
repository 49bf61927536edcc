"""``megatron-rlhf tools --config CONFIG --call NAME --args JSON``: one call, exactly as a run
makes it (the same checks, sandbox, limits, cut and rendering), printed with the tokens a run
would append after the policy's turn."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from megatron_rlhf.agent_tools.executor import ToolSession
from megatron_rlhf.agent_tools.parsers import make_call
from megatron_rlhf.agent_tools.render import append_ids, check_template
from megatron_rlhf.agent_tools.spec import check_tool_settings, tool_schemas
from megatron_rlhf.errors import UserError

ROLLOUT_DEFAULTS = dict(tools=[], tools_file=None, tool_call_format="auto", sandbox="require",
                        max_assistant_turns=4, tool_workers=1, tool_check=False)


def read_rollout(config_path: str) -> tuple[SimpleNamespace, dict]:
    """The ``rollout`` tool keys of a YAML file (a PPO config or any file with ``rollout.tools``)
    and the whole file as a dict."""
    import yaml

    path = Path(config_path)
    if not path.is_file():
        raise UserError(f"config file not found: {config_path}")
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError(f"config file {config_path}: not valid YAML ({' '.join(str(err).split())})") from None
    rollout = loaded.get("rollout") if isinstance(loaded, dict) else None
    if not isinstance(rollout, dict) or not (rollout.get("tools") or rollout.get("tools_file")):
        raise UserError(f"config file {config_path}: no rollout.tools or rollout.tools_file")
    keys = {k: rollout.get(k, v) for k, v in ROLLOUT_DEFAULTS.items()}
    return SimpleNamespace(**keys), loaded


def tokenizer_path(loaded: dict, given: str | None) -> str:
    """``--tokenizer``, else the config's ``actor.model_path`` or ``model.path``."""
    if given:
        return given
    for section, key in (("actor", "model_path"), ("model", "path")):
        value = (loaded.get(section) or {}).get(key) if isinstance(loaded.get(section), dict) else None
        if value:
            return str(value)
    raise UserError("tools: a tokenizer is needed to render the result; the config has no "
                    "actor.model_path or model.path: pass --tokenizer PATH")


def run_tool_call(rollout, tokenizer, name: str, args_json: str) -> int:
    """Run one call and print its result and the ids a run would append."""
    tools = check_tool_settings(rollout)
    fmt = check_template(tokenizer, tools, rollout.tool_call_format)
    try:
        arguments = json.loads(args_json)
    except json.JSONDecodeError as err:
        raise UserError(f"tools: --args is not JSON ({err.msg} at character {err.pos})") from None
    call = make_call(name, arguments, args_json, {tool.name: tool for tool in tools})
    with ToolSession(tools, tokenizer, workers=1, sandbox=rollout.sandbox) as session:
        where = session.isolation
        result = session.run_round([call])[0]
    ids = append_ids(tokenizer, [result], tool_schemas(tools))
    if where is not None:
        print(f"sandbox: {'bwrap namespaces + resource limits' if where.bwrap else where.missing}")
    print(f"format: {fmt}")
    print(f"tool: {result.name}  error: {result.error}  timeout: {result.timeout}  "
          f"truncated: {result.truncated}")
    print("result:")
    print(result.text)
    print(f"appended tokens ({len(ids)}): {ids}")
    print(f"appended text: {tokenizer.decode(ids)!r}")
    return 0
