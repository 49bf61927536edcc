"""SFT on tool-call traces (issue 37 item 6's data): the three-digit addition task's traces render
through the tiny tool template exactly as a tool rollout builds them, their calls parse back to
the calculator with the question's sum, and the SFT loss is on the assistant turns only."""

import pyarrow.parquet as pq
import pytest
import torch

from megatron_rlhf.agent_tools.calculator import calculate
from megatron_rlhf.agent_tools.executor import ToolResult
from megatron_rlhf.agent_tools.parsers import Call, parse_calls
from megatron_rlhf.agent_tools.render import append_ids, check_template
from megatron_rlhf.agent_tools.spec import load_tools, tool_schemas
from megatron_rlhf.data.sft import load_samples, sft_batch

TOOLS = load_tools([{"name": "calculator"}])


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from transformers import AutoTokenizer

    from megatron_rlhf.demo import prepare_tool_task

    root = tmp_path_factory.mktemp("tool_task")
    prepare_tool_task(root, seed=0, train=64, val=16)
    return root, AutoTokenizer.from_pretrained(root / "base")


def _split(ids, mask, value):
    """The runs of ``ids`` whose ``mask`` is ``value``, in order."""
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m == value:
            current.append(token)
        elif current:
            runs, current = runs + [current], []
    return runs + [current] if current else runs


def test_held_out_questions_are_never_trained_on(workspace):
    root, _ = workspace
    trained = set(pq.read_table(root / "data" / "sft_train.parquet").column("prompt").to_pylist())
    trained |= set(pq.read_table(root / "data" / "prompts_train.parquet").column("prompt").to_pylist())
    held_out = set(pq.read_table(root / "data" / "prompts_val.parquet").column("prompt").to_pylist())
    assert held_out and not held_out & trained


def test_a_trace_is_what_a_tool_rollout_makes_and_only_its_assistant_turns_are_trained(workspace):
    root, tok = workspace
    assert check_template(tok, TOOLS, "auto") == "hermes"
    schemas = tool_schemas(TOOLS)
    rows = pq.read_table(root / "data" / "sft_train.parquet").to_pylist()
    samples, _ = load_samples([str(root / "data" / "sft_train.parquet")], tok, 64, 64, "drop", schemas)
    eot = tok.eos_token_id
    calls = 0
    for row, sample in zip(rows, samples):
        a, b = (int(x) for x in row["prompt"].removeprefix("What is ").rstrip("?").split(" + "))
        head = list(sample.ids[:sample.prompt_tokens])
        assert "calculator" in tok.decode(head)  # the prompt shows the tool
        response = list(sample.ids[sample.prompt_tokens:])
        if len(row["response"]) == 1:  # a direct answer: every response token is trained
            assert sample.mask is None and sample.target_tokens == len(response)
            continue
        calls += 1
        mask = sample.mask[sample.prompt_tokens:]
        assert set(sample.mask[:sample.prompt_tokens]) == {0}
        call, answer = _split(response, mask, 1)
        (environment,) = _split(response, mask, 0)
        assert call[-1] == eot and answer[-1] == eot  # each turn ends with the policy's own stop
        parsed = parse_calls(tok.decode(call[:-1], skip_special_tokens=False), "hermes", TOOLS)
        assert len(parsed) == 1 and isinstance(parsed[0], Call)
        assert (parsed[0].name, parsed[0].arguments) == ("calculator", {"expression": f"{a} + {b}"})
        result = calculate(parsed[0].arguments["expression"])
        # The masked tokens are exactly the ids a tool rollout appends after the call's turn.
        assert environment == append_ids(tok, [ToolResult("calculator", result)], schemas)
        assert tok.decode(answer[:-1]) == f"The answer is {a + b}."
        assert sample.target_tokens == len(call) + len(answer)
    assert 0 < calls < len(samples)  # the mixture: some traces call, some answer directly


def test_the_sft_loss_mask_follows_the_trace_mask(workspace):
    root, tok = workspace
    samples, _ = load_samples([str(root / "data" / "sft_train.parquet")], tok, 64, 64, "drop",
                              tool_schemas(TOOLS))
    batch = sft_batch(samples[:8], 128, tok.pad_token_id, remove_padding=False, loss_scale=1.0)
    assert batch["loss_mask"].sum() == sum(s.target_tokens for s in samples[:8])
    for row, sample in enumerate(samples[:8]):
        mask = sample.mask or [0] * sample.prompt_tokens + [1] * sample.target_tokens
        n = len(sample.ids)
        # Position p predicts token p + 1: a target is trained exactly when its token is.
        assert batch["loss_mask"][row, :n - 1].tolist() == [float(m) for m in mask[1:]]
        assert torch.equal(batch["targets"][row, :n - 1], torch.tensor(sample.ids[1:]))
