"""Multi-turn tool rollouts (issue 37), token in and token out: the loop of
megatron_rlhf/rollout/tool_turns.py with a scripted policy (exact control of its calls) on a
Qwen-style tiny tokenizer and SmolLM2's real one, with the real `hf` engine on a tiny model built
to call a tool, the experience and every estimator over such trajectories, the start-up checks,
and one short PPO run with tools."""

import json
import math

import pytest
import torch

from megatron_rlhf.agent_tools.executor import ToolResult, ToolSession
from megatron_rlhf.agent_tools.render import append_ids
from megatron_rlhf.agent_tools.spec import load_tools, tool_schemas
from megatron_rlhf.rollout.base import Generation, SamplingParams
from megatron_rlhf.rollout.tool_turns import ToolEnv, run_tool_turns
from tests.test_agent_tools import qwen_like, smollm2_tokenizer  # noqa: F401  (fixtures)
from tests.tool_fns import ARGS

TOOLS = load_tools([{"name": "calculator"},
                    {"name": "square", "fn": "tests.tool_fns:square", "description": "x squared",
                     "parameters": ARGS}])
CALC = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
SQUARES = ('<tool_call>{"name": "square", "arguments": {"x": 3}}</tool_call>'
           '<tool_call>{"name": "square", "arguments": {"x": "three"}}</tool_call>')
# What the scripted policy says, per prompt, turn after turn.
SCRIPTS = [["Let me compute. " + CALC, "The answer is 42."],
           [CALC, CALC, CALC, CALC],  # calls until the turn limit
           [SQUARES, "It is 9."]]
LOGPROB = -0.25  # every policy token's log-prob, so the environment's 0.0 stand out


class ScriptedPolicy:
    """``generate`` for :func:`run_tool_turns`: each context's next turn from :data:`SCRIPTS`
    (found by its prompt; ``n`` = 1), with the end-of-turn token; records what it was given."""

    def __init__(self, tokenizer, prompts: list[list[int]]):
        self.tokenizer, self.prompts, self.contexts = tokenizer, prompts, []
        self.turns = [0] * len(prompts)

    def __call__(self, contexts: list[list[int]], params: SamplingParams) -> list[Generation]:
        self.contexts.append(contexts)
        eot = self.tokenizer.eos_token_id
        out = []
        for index, context in enumerate(contexts):
            prompt = next(i for i, p in enumerate(self.prompts) if context[:len(p)] == p)
            turn, self.turns[prompt] = self.turns[prompt], self.turns[prompt] + 1
            ids = self.tokenizer(SCRIPTS[prompt][turn], add_special_tokens=False)["input_ids"] + [eot]
            cut = ids[:params.max_tokens]
            out.append(Generation(index, cut, [LOGPROB] * len(cut), len(cut) == len(ids)))
        return out


def _prompts(tokenizer, schemas):
    messages = [[{"role": "user", "content": f"Question {i}: what is 6 times 7?"}] for i in range(3)]
    ids = [tokenizer(tokenizer.apply_chat_template(m, tools=schemas, tokenize=False,
                                                   add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"] for m in messages]
    return messages, ids


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("which", ["qwen_like", "smollm2"])
def test_trajectories_are_the_policys_tokens_plus_the_rendered_tool_tokens(which, request):
    tok = (request.getfixturevalue("qwen_like")[0] if which == "qwen_like"
           else request.getfixturevalue("smollm2_tokenizer"))
    schemas = tool_schemas(TOOLS)
    messages, prompts = _prompts(tok, schemas)
    policy = ScriptedPolicy(tok, prompts)
    with ToolSession(TOOLS, tok, workers=2) as session:
        env = ToolEnv(session, TOOLS, "hermes", tok, max_turns=3, check=True)
        gens, metrics = run_tool_turns(policy, prompts, SamplingParams(max_tokens=400), env,
                                       rows=[{}] * 3, messages=messages)
    eot = [tok.eos_token_id]
    calc = append_ids(tok, [ToolResult("calculator", "42")], schemas)
    squares = append_ids(tok, [ToolResult("square", "9"), ToolResult(
        "square", "Error: invalid arguments for square: x: 'three' is not of type 'integer'",
        error=True)], schemas)
    expected = [  # (token segments, is it the policy's)
        [(_ids(tok, SCRIPTS[0][0]) + eot, 1), (calc, 0), (_ids(tok, SCRIPTS[0][1]) + eot, 1)],
        [(_ids(tok, CALC) + eot, 1), (calc, 0), (_ids(tok, CALC) + eot, 1), (calc, 0),
         (_ids(tok, CALC) + eot, 1)],
        [(_ids(tok, SQUARES) + eot, 1), (squares, 0), (_ids(tok, SCRIPTS[2][1]) + eot, 1)]]
    for gen, segments in zip(gens, expected):
        assert gen.tokens == [i for ids, _ in segments for i in ids]
        assert gen.mask == [m for ids, m in segments for _ in ids]
        assert gen.logprobs == [LOGPROB if m else 0.0 for ids, m in segments for _ in ids]
        assert gen.finished and len(gen.turn_ends) == sum(m for _, m in segments)
    # The policy continued from exactly its own ids plus the appended ones, never re-tokenised.
    assert policy.contexts[1][0] == prompts[0] + gens[0].tokens[:len(gens[0].tokens)
                                                                 - len(_ids(tok, SCRIPTS[0][1])) - 1]
    assert [len(c) for c in policy.contexts] == [3, 3, 1]  # the third round: prompt 1 alone
    assert metrics["tools/template_mismatch"] == 0.0
    assert metrics["tools/calls"] == 5.0 and metrics["tools/errors"] == 1.0
    assert metrics["tools/calculator/calls"] == 3.0 and metrics["tools/square/errors"] == 1.0
    assert metrics["tools/unanswered"] == 1.0  # prompt 1's third call: the turn limit
    assert metrics["tools/turns_mean"] == 7 / 3 and metrics["tools/calls_per_sample"] == 5 / 3


def test_the_response_budget_ends_trajectories_tool_tokens_included(qwen_like):
    tok = qwen_like[0]
    schemas = tool_schemas(TOOLS)
    messages, prompts = _prompts(tok, schemas)
    first = len(_ids(tok, SCRIPTS[0][0])) + 1
    calc = append_ids(tok, [ToolResult("calculator", "42")], schemas)
    with ToolSession(TOOLS, tok, workers=1) as session:
        env = ToolEnv(session, TOOLS, "hermes", tok, max_turns=4, check=True)
        # Room for the first turn and the tool tokens but not one more token: the result is
        # never appended and the trajectory counts as cut.
        params = SamplingParams(max_tokens=first + len(calc))
        gens, metrics = run_tool_turns(ScriptedPolicy(tok, prompts[:1]), prompts[:1], params, env,
                                       messages=messages[:1])
        assert gens[0].tokens == _ids(tok, SCRIPTS[0][0]) + [tok.eos_token_id]
        assert not gens[0].finished and metrics["tools/unanswered"] == 1.0
        # Two tokens more: the next turn is cut at the budget, mid-way.
        params = SamplingParams(max_tokens=first + len(calc) + 2)
        gens, metrics = run_tool_turns(ScriptedPolicy(tok, prompts[:1]), prompts[:1], params, env,
                                       messages=messages[:1])
    assert len(gens[0].tokens) == params.max_tokens and not gens[0].finished
    assert gens[0].mask == [1] * first + [0] * len(calc) + [1, 1]
    assert gens[0].tokens[-2:] == _ids(tok, SCRIPTS[0][1])[:2]
    assert metrics["tools/template_mismatch"] == 0.0  # a cut last turn is compared up to the cut


# --- the real hf engine on a tiny model that calls a tool -------------------------------------

@pytest.fixture(scope="module")
def caller(tmp_path_factory):
    """Task prompts and a tiny policy that calls the calculator (tests/tiny_models.py), the
    answer's logit 1 below the call's: greedy always calls, temperature 1 answers about a
    quarter of the time."""
    from megatron_rlhf.data.task_files import write_task_files
    from tests.tiny_models import build_tool_caller

    root = tmp_path_factory.mktemp("tool_caller")
    write_task_files(str(root / "data"), train=64, val=8, seed=0, high=19)
    build_tool_caller(root / "base", answer_margin=1.0)
    return root


def _engine_and_env(caller):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rlhf.config.ppo_schema import RolloutConfig, ToolConfig
    from megatron_rlhf.data.prompts import load_prompts
    from megatron_rlhf.rollout.hf_engine import HFGenerator
    from megatron_rlhf.rollout.tool_turns import make_tool_env

    base = str(caller / "base")
    tok = AutoTokenizer.from_pretrained(base)
    engine = HFGenerator(base, torch.float32, tok.pad_token_id, tok.eos_token_id)
    engine.load_weights(AutoModelForCausalLM.from_pretrained(base).state_dict().items())
    env = make_tool_env(RolloutConfig(tools=[ToolConfig(name="calculator")], max_assistant_turns=3,
                                      tool_check=True, tool_workers=1), tok)
    prompts = load_prompts([str(caller / "data" / "prompts_val.parquet")], tok, "prompt",
                           "ground_truth", 128, "drop", False, tools=env.schemas)[0][:4]
    return tok, engine, env, prompts


def test_the_hf_engine_continues_from_its_own_tokens_and_the_tool_tokens(caller):
    from tests.tiny_models import TOOL_ANSWER, TOOL_CALL

    tok, engine, env, prompts = _engine_and_env(caller)
    ids, messages = [list(p.ids) for p in prompts], [list(p.messages) for p in prompts]
    assert "calculator" in tok.decode(ids[0])  # the schemas reached the prompt
    call, answer, eot = (tok.convert_tokens_to_ids(TOOL_CALL), tok.convert_tokens_to_ids(TOOL_ANSWER),
                         tok.eos_token_id)
    calc = append_ids(tok, [ToolResult("calculator", "42")], env.schemas)
    try:
        greedy = SamplingParams(max_tokens=64, temperature=0.0, seed=1)
        gens, metrics = run_tool_turns(engine.generate, ids, greedy, env, messages=messages)
        turn = [call, eot]  # greedy calls every turn: the turn limit ends each trajectory
        assert all(g.tokens == turn + calc + turn + calc + turn and g.finished for g in gens)
        assert all(g.mask == [1, 1] + [0] * len(calc) + [1, 1] + [0] * len(calc) + [1, 1]
                   for g in gens)
        assert metrics["tools/calls"] == 8 and metrics["tools/unanswered"] == 4
        assert metrics["tools/template_mismatch"] == 0 and metrics["tools/turns_mean"] == 3
        # Temperature 1, four samples a prompt: some answer at once, some after a call or two.
        sampled = SamplingParams(max_tokens=64, temperature=1.0, n=4, seed=3)
        gens, metrics = run_tool_turns(engine.generate, ids, sampled, env, messages=messages)
        ends = set()
        for g in gens:
            k = len(g.turn_ends)
            policy = [tok for tok, m in zip(g.tokens, g.mask) if m]
            assert policy == [call, eot] * (k - 1) + [call if k == 3 and policy[-2] == call
                                                      else answer, eot]
            assert [t for t, m in zip(g.tokens, g.mask) if not m] == calc * (k - 1)
            # The engine's log-probs: its own on its tokens (a call or answer: a coin flip of
            # odds e to 1), 0 on the tool's.
            assert all(lp == 0.0 for lp, m in zip(g.logprobs, g.mask) if not m)
            assert all(lp < -0.1 for lp, t in zip(g.logprobs, g.tokens) if t in (call, answer))
            ends.add((k, policy[-2] == answer))
        assert {(1, True), (3, False)} <= ends and metrics["tools/template_mismatch"] == 0
        # A budget two tokens past the first tool answer: the second turn is cut mid-way.
        gens, _ = run_tool_turns(engine.generate, ids, SamplingParams(max_tokens=3 + len(calc),
                                 temperature=0.0), env, messages=messages)
        assert all(g.tokens == [call, eot] + calc + [call] and not g.finished for g in gens)
    finally:
        env.close()


# --- experience, losses and every estimator over tool trajectories ----------------------------

def _estimators():
    from megatron_rlhf.algorithms.estimators import ESTIMATORS

    return sorted(ESTIMATORS)


@pytest.mark.parametrize("estimator", _estimators())
def test_advantages_and_rewards_stay_on_the_policys_tokens(estimator):
    from megatron_rlhf.config.ppo_schema import AlgorithmConfig
    from megatron_rlhf.trainers.rl.experience import build_batch, compute_advantages, engine_logprobs

    # Two trajectories of one prompt: policy 3 tokens, tool 2, policy 2; and a single turn.
    gens = [Generation(0, [5, 6, 7, 8, 9, 10, 11], [-1.0] * 3 + [0.0] * 2 + [-1.0] * 2, True,
                       mask=[1, 1, 1, 0, 0, 1, 1], turn_ends=[2, 6]),
            Generation(0, [5, 6, 12], [-1.0] * 3, True, mask=[1, 1, 1], turn_ends=[2])]
    batch = build_batch([(1, 2, 3)], gens, pad_id=0)
    mask = batch["loss_mask"]
    assert mask[0].tolist() == [0, 0, 1, 1, 1, 0, 0, 1, 1, 0] and mask[1].sum() == 3
    batch["values"] = torch.rand(mask.shape)
    batch["old_logprobs"], batch["ref_logprobs"] = -torch.rand(mask.shape), -torch.rand(mask.shape)
    out = compute_advantages(batch, torch.tensor([1.0, 0.0]), AlgorithmConfig(adv_estimator=estimator),
                             kl_coef=0.1)
    for key in ("advantages", "returns", "kl"):
        assert (out[key][mask == 0] == 0).all(), key
    assert out["advantages"][0][mask[0] > 0].abs().sum() > 0
    # The score lands on the last policy token, and only there (no KL in the reward).
    assert out["rewards"][0].nonzero().flatten().tolist() == [8] and out["rewards"][0, 8] == 1.0
    # The engine's log-probs of tool tokens (0 by construction) sit where the mask is 0.
    engine = engine_logprobs(gens, mask)
    assert (engine[0][mask[0] > 0] == -1.0).all() and (engine * (1 - mask)).abs().sum() == 0


@pytest.mark.parametrize("workers", [0, 1])
def test_a_reward_function_scores_each_turn_of_a_tool_trajectory(workers):
    """``turn_scores`` from a reward function reading ``extra["trajectory"]``, in-process and
    through the reward pool; malformed lists and lists of the wrong length are refused."""
    from megatron_rlhf.errors import UserError
    from megatron_rlhf.rewards.registry import as_score
    from megatron_rlhf.rewards.scorer import RewardScorer
    from megatron_rlhf.trainers.rl.agent import _turn_lists

    trajectory = [{"role": "assistant", "content": CALC}, {"role": "tool", "content": "42"},
                  {"role": "assistant", "content": CALC}, {"role": "tool", "content": "Error: x"},
                  {"role": "assistant", "content": "42"}]
    with RewardScorer.from_specs("tests.tool_fns:turn_reward", None, workers=workers) as scorer:
        scores, turns = scorer.score_turns("fn", [("42", "42", "q", {"trajectory": trajectory}),
                                                  (CALC, "42", "q", {"trajectory": trajectory[:1]})])
    assert scores == [1.0, 0.0] and turns == [(0.25, 0.0, 1.0), (0.0,)]
    assert as_score({"score": 1, "turn_scores": [0.5, 1]}) == (1.0, {"turn_scores": (0.5, 1.0)})
    for bad in ("0.5", [float("nan")], [], 3, [None]):
        with pytest.raises((TypeError, ValueError)):
            as_score({"score": 1, "turn_scores": bad})
    gens = [Generation(0, [1, 2, 3, 4], [0.0] * 4, True, mask=[1, 0, 0, 1], turn_ends=[0, 3]),
            Generation(0, [5, 6], [0.0] * 2, True, mask=[1, 1], turn_ends=[1])]
    # A sample whose function gave no turn scores keeps its score on its last turn.
    assert _turn_lists([(0.25, 1.0), None], [1.0, 0.5], gens, "f") == [[0.25, 1.0], [0.5]]
    assert _turn_lists([None, None], [1.0, 0.5], gens, "f") == [[0.0, 1.0], [0.5]]
    with pytest.raises(UserError, match="returned 1 turn_scores for sample 0, a trajectory of 2"):
        _turn_lists([(1.0,), None], [1.0, 0.5], gens, "f")


# --- start-up checks and one short PPO run with tools ------------------------------------------

@pytest.mark.parametrize("setting, message", [
    ("rollout.max_turns=2", "rollout.max_turns=2 (the retry dialogue)"),
    ("rollout.backend=sglang", "rollout.backend=sglang (token ids in like hf, but not run"),
    ("data.overlong=truncate", "data.overlong=truncate (it cuts prompts from the left"),
    ("algorithm.filter_groups.enable=true", "algorithm.filter_groups")])
def test_what_tools_do_not_combine_with_is_refused_at_start_up(tmp_path, setting, message):
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_checks import validate_ppo_config
    from megatron_rlhf.config.ppo_schema import PPOConfig
    from megatron_rlhf.errors import UserError

    path = tmp_path / "ppo.yaml"
    path.write_text("rollout:\n  tools:\n    - name: calculator\n")
    base = [f"actor.model_path={tmp_path}", f"data.train_files=[{tmp_path / 'p.parquet'}]",
            "reward.fn=addition", "algorithm.adv_estimator=grpo", "rollout.n=2"]
    validate_ppo_config(load_config(PPOConfig, str(path), base))  # alone: fine
    import re

    with pytest.raises(UserError, match=re.escape("rollout.tools is not supported with " + message)):
        validate_ppo_config(load_config(PPOConfig, str(path), base + [setting]))


ONE_STEP_OFF = ("rollout.placement=separate", "rollout.world_size=1", "rollout.max_staleness=1",
                "trainer.save_every_steps=1", "trainer.keep_last_n=5", "rollout.tool_workers=16")
# One step off, the calculator answers after 3 s (all of a round's calls at once): longer than
# a tiny update (0.2 s beside another test file; with a 5 s round the weight sync waited 4.6 s
# for it), so the weight sync comes while a step's trajectories wait for their tool round.
SLOW_CALCULATOR = """- name: calculator
  fn: tests.tool_fns:slow_calculator
  description: evaluates an arithmetic expression
  timeout_s: 30
  parameters:
    type: object
    properties: {expression: {type: string}}
    required: [expression]
"""


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["on_policy", "one_step_off"])
def test_ppo_with_tools_trains_on_the_policys_tokens_and_logs_tool_metrics(caller, tmp_path, schedule):
    """Two runs of a tiny policy that calls the calculator, rewarded per turn by
    tests/tool_fns.py:turn_reward: on-policy on the actor's ranks, and one step off on a separate
    rollout group (the driver's thread runs each step's tool rounds while the trainers update)."""
    from transformers import AutoTokenizer

    from tests.ppo_helpers import finish, metrics, overrides, ppo

    tools = tmp_path / "tools.yaml"
    tools.write_text("- name: calculator\n" if schedule == "on_policy" else SLOW_CALCULATOR)
    out = tmp_path / "run"
    steps = 2 if schedule == "on_policy" else 3
    args = overrides(caller, out, f"rollout.tools_file={tools}",
                     f"rollout.max_assistant_turns={3 if schedule == 'on_policy' else 2}",
                     "rollout.tool_check=true", "data.max_prompt_length=96",
                     "data.max_response_length=40", f"trainer.max_steps={steps}",
                     "trainer.eval_every_steps=0", "trainer.val_before_train=false",
                     "reward.fn=tests.tool_fns:turn_reward", "reward.workers=0",
                     f"trainer.rollout_data_dir={out / 'rollouts'}",
                     *(ONE_STEP_OFF if schedule == "one_step_off" else ()))
    code, stdout, stderr = finish(ppo(args))
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    rows = [r for r in metrics(out) if "actor/pg_loss" in r]
    assert len(rows) == steps
    for r in rows:
        assert r["tools/calls"] > 0 and r["tools/calculator/calls"] == r["tools/calls"]
        assert r["tools/template_mismatch"] == 0 and r["tools/errors"] == 0
        assert 1 < r["tools/turns_mean"] <= 3 and r["tools/calls_per_sample"] > 0
        assert math.isfinite(r["actor/pg_loss"]) and math.isfinite(r["critic/vf_loss"])
    if schedule == "on_policy":
        assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in rows)  # engine = actor
    else:
        _check_one_step_off(caller, out, rows)
    # What was trained on: the policy's turns (mask 1, each closed by its end-of-turn token) and
    # between them exactly the template's tool tokens (mask 0).
    tok = AutoTokenizer.from_pretrained(caller / "base")
    calc = append_ids(tok, [ToolResult("calculator", "42")], tool_schemas(load_tools(
        [{"name": "calculator"}])))
    samples = [json.loads(line) for path in sorted((out / "rollouts").glob("step_*.jsonl"))
               for line in path.read_text().splitlines()]
    assert len(samples) == 16 * steps and any(0 in s["mask"] for s in samples)
    for s in samples:
        ids, mask = s["response_ids"], s["mask"]
        runs, start = [], 0
        for i in range(1, len(ids) + 1):
            if i == len(ids) or mask[i] != mask[start]:
                runs.append((mask[start], ids[start:i]))
                start = i
        assert all(part == calc for m, part in runs if m == 0)
        assert all(part[-1] == tok.eos_token_id for m, part in runs if m == 1)
        assert all(lp == 0.0 for lp, m in zip(s["logprobs"], mask) if m == 0)
        # The reward function's turn scores, each on its turn (tests/tool_fns.py:turn_reward):
        # 0.25 per answered call, 1 for ending on an answer; the score is their sum.
        policy_turns = [part for m, part in runs if m == 1]
        calls = [tok.decode(part).count("<tool_call>") for part in policy_turns]
        expected = [0.25 * c for c in calls[:-1]] + [0.0 if calls[-1] else 1.0]
        assert s["turn_rewards"] == pytest.approx(expected)
        assert s["score"] == pytest.approx(sum(expected))
        assert [m["role"] for m in s["messages"]].count("assistant") == len(policy_turns)
    assert {s["score"] for s in samples} != {samples[0]["score"]}  # the rewards differ


def _check_one_step_off(caller, out, rows):
    """Steps 2 and 3 were sampled by the weights of the step before, every turn of them (the
    weight sync waits for the rounds started ahead), while the previous step updated."""
    import torch

    from megatron_rlhf.cli import main
    from tests.ppo_helpers import teacher_forced

    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    raw = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
           if "actor/pg_loss" in line]
    assert all(r["timing/overlap"] > 0 for r in raw[1:])
    # The 8 s calculator outlasts the tiny update: a weight sync came while the next step's
    # trajectories waited for a tool round, and waited for them (every turn above: one version).
    assert any(r["rollout/tool_rounds_at_sync"] > 0 for r in raw), [r.get("rollout/tool_rounds_at_sync") for r in raw]
    weights = {0: caller / "base"}
    for step in (1, 2):
        weights[step] = out / f"hf_{step}"
        assert main(["convert", "mcore-to-hf", "--mcore-dir", str(out / "checkpoints" / "actor" /
                     f"step_{step:08d}"), "--out-dir", str(weights[step])]) == 0
    for step in (1, 2):
        dumped = [json.loads(line) for line in (out / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
        assert {r["weight_version"] for r in dumped} == {step - 1}
        policy = torch.tensor([m for r in dumped for m in r["mask"]]) == 1
        engine = torch.tensor([lp for r in dumped for lp in r["logprobs"]])[policy]
        previous, current = (teacher_forced(weights[v], dumped)[policy] for v in (step - 1, step))
        assert (engine - previous).abs().max() < 1e-5  # every turn: the previous weights
        assert (engine - current).abs().max() > 1e-4



@pytest.mark.slow
def test_a_population_of_agents_calls_tools(caller, tmp_path):
    """multi_agent.mode=population with tools: both agents roll out tool trajectories on the
    same prompts, each logs its own tools/* metrics, and the preference table covers them; the
    two-player modes, which write their own prompts and turns, refuse tools at start-up."""
    from megatron_rlhf.config.agents import check_agents
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_schema import PPOConfig
    from megatron_rlhf.errors import UserError
    from tests.ppo_helpers import finish, metrics, ppo

    base, data, out = caller / "base", caller / "data", tmp_path / "pop"
    args = [f"agents=[{{name: a, model_path: {base}}}, {{name: b, model_path: {base}}}]",
            "multi_agent.mode=population", "rollout.tools=[{name: calculator}]",
            "rollout.max_assistant_turns=2", f"data.train_files=[{data / 'prompts_train.parquet'}]",
            "data.max_prompt_length=96", "data.max_response_length=40", "data.train_batch_size=4",
            "rollout.n=4", "actor.ppo_mini_batch_size=16", "actor.ppo_micro_batch_size_per_rank=8",
            "actor.ppo_epochs=1", "algorithm.adv_estimator=sppo", "actor.policy_loss=sppo",
            "actor.loss_agg_mode=seq-mean-token-mean", "algorithm.use_kl_in_reward=false",
            "reward.fn=tests.tool_fns:turn_reward",
            "reward.workers=0", "trainer.max_steps=1", "trainer.eval_every_steps=0",
            "trainer.val_before_train=false", "trainer.logger=console", f"trainer.output_dir={out}"]
    for mode in ("proposer-solver", "critique-revise"):
        with pytest.raises(UserError, match=f"rollout.tools is not supported with multi_agent.mode={mode}"):
            check_agents(load_config(PPOConfig, None, args + [f"multi_agent.mode={mode}",
                                                                    "algorithm.adv_estimator=grpo",
                                                                    "actor.policy_loss=vanilla"]))
    code, stdout, stderr = finish(ppo(args))
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    row = next(r for r in metrics(out) if "agent/a/actor/pg_loss" in r)
    for name in ("a", "b"):
        assert row[f"agent/{name}/tools/calls"] > 0 and row[f"agent/{name}/tools/errors"] == 0
        assert 1 < row[f"agent/{name}/tools/turns_mean"] <= 2
        assert math.isfinite(row[f"agent/{name}/actor/pg_loss"])
    assert row["population/win_rate/a/b"] + row["population/win_rate/b/a"] == pytest.approx(1.0)
