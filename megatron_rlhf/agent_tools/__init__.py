"""Tools a policy may call during its rollouts (issue 37): the environment below ``rollout``.

What a multi-turn rollout needs, in the order it uses it (docs/tools.md):

- start-up: ``spec.check_tool_settings(cfg.rollout)`` -> ``list[ToolSpec]`` (also run by the
  config checks); once the tokenizer is loaded, ``render.check_template(tokenizer, tools,
  cfg.rollout.tool_call_format)`` -> the call format; ``executor.ToolSession(tools, tokenizer,
  cfg.rollout.tool_workers, cfg.rollout.sandbox)``; render prompts with
  ``tools=spec.tool_schemas(tools)``;
- each round: ``parsers.parse_calls(turn_text, fmt, tools)`` -> ``[Call | ParseError]`` per
  sample; ``session.run_round(all_calls, rows)`` -> ``[ToolResult]``;
  ``render.append_ids(tokenizer, results_of_one_sample, schemas)`` -> the ids to append after
  that sample's tokens (mask 0); ``executor.tool_metrics(results)`` -> ``tools/*`` counts;
- ``rollout.tool_check``: ``render.template_mismatch(...)`` -> ``tools/template_mismatch``.

The RL loop drives these turns in :mod:`megatron_rlhf.rollout.tool_turns` (``make_tool_env`` at
start-up, ``run_tool_turns`` per generation).
"""
