"""Multi-agent pieces without Ray: the win-rate matrix and the proposer's reward against loops,
the config checks (one clear line each), and every play mode on scripted agents (what each
agent sees, what it is scored on, which tokens carry its loss)."""

import torch
import pytest

from megatron_rlhf.algorithms.multi_agent import agent_win_matrix, learnability
from megatron_rlhf.algorithms.sppo import pairwise_preferences, win_rates
from megatron_rlhf.config.loader import load_config
from megatron_rlhf.config.ppo_schema import PPOConfig
from megatron_rlhf.data.tasks import parse_question
from megatron_rlhf.errors import UserError
from megatron_rlhf.config.agents import agent_config, check_agents, judges, pools
from megatron_rlhf.trainers.rl.modes import CritiqueRevise, Population, ProposerSolver
from megatron_rlhf.rollout.base import Generation
from megatron_rlhf.trainers.rl.agent import PPORun, Timer


def test_win_matrix_matches_a_loop_and_is_complementary():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(24, generator=gen)
    groups = torch.arange(4).repeat_interleave(2).repeat(3)  # 3 agents x 4 prompts x 2 samples
    owners = torch.arange(3).repeat_interleave(8)
    table = pairwise_preferences(scores, "bradley_terry")
    matrix = agent_win_matrix(table, groups, owners, 3)
    for a in range(3):
        for b in range(3):
            pairs = [table[i, j] for i in range(24) for j in range(24)
                     if i != j and groups[i] == groups[j] and owners[i] == a and owners[j] == b]
            assert torch.allclose(matrix[a, b], torch.stack(pairs).mean(), atol=1e-6)
            assert abs(float(matrix[a, b] + matrix[b, a]) - 1.0) < 1e-6
    assert torch.allclose(matrix.diagonal(), torch.full((3,), 0.5), atol=1e-6)


def test_learnability_by_hand():
    rates = torch.tensor([0.0, 0.25, 0.5, 1.0, 0.5])
    valid = torch.tensor([True, True, True, True, False])
    assert learnability(rates, valid).tolist() == [0.0, 0.5, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("text,expected", [("What is 12 + 7?", (12, 7)), ("3 and 4 and 5", (3, 4)),
                                           ("The answer is 19.", None), ("What is 120 + 1?", None),
                                           ("", None)])
def test_proposals_parse_as_two_operands_in_range(text, expected):
    assert parse_question(text) == expected


def _cfg(*overrides):
    base = ["data.train_files=[x.parquet]", "agents=[{name: a, model_path: m1}, {name: b, model_path: m2}]",
            "algorithm.adv_estimator=sppo", "actor.policy_loss=sppo",
            "actor.loss_agg_mode=seq-mean-token-mean", "reward.fn=addition",
            "algorithm.use_kl_in_reward=false", "multi_agent.mode=population"]
    return load_config(PPOConfig, None, base + list(overrides))


@pytest.mark.parametrize("overrides,message", [
    (["agents=[{name: a, model_path: m}, {name: a, model_path: n}]"], "clashes with an earlier agent"),
    (["agents=[{name: a, model_path: m}]"], "population plays two or more agents"),
    (["agents=[{name: 'a b', model_path: m}, {name: c, model_path: n}]"], "must be letters"),
    (["multi_agent.mode=chess"], "multi_agent.mode='chess' must be one of"),
    (["algorithm.adv_estimator=grpo", "actor.policy_loss=vanilla"], "population trains every agent with SPPO"),
    (["multi_agent.mode=proposer-solver"], "scores each agent on its own"),
    (["multi_agent.proposer=zed"], "multi_agent.proposer='zed' is not an agent"),
    (["algorithm.filter_groups.enable=true"], "not supported with multi_agent.mode=population"),
    (["multi_agent.mode=critique-revise", "algorithm.adv_estimator=grpo", "actor.policy_loss=vanilla",
      "rollout.tools=[{name: calculator}]"], "rollout.tools is not supported with multi_agent.mode=critique-revise"),
    (["resource_pool.critic=separate", "multi_agent.mode=solo"], "for one agent"),
    (["reward.model_path=rm", "agents.1.reward_model_path=rm_b"], "needs one preference model"),
    (["agents.1.reward_model_path=rm_b"], "needs one preference model"),  # b an RM, a none
    (["multi_agent.mode=proposer-solver", "algorithm.adv_estimator=grpo", "actor.policy_loss=vanilla",
      "agents.0.reward_model_path=rm"], r"agents\[0\].reward_model_path: a is the proposer"),
])
def test_bad_agent_configs_are_one_clear_line(overrides, message):
    with pytest.raises(UserError, match=message):
        check_agents(_cfg(*overrides))


def test_an_agent_without_a_model_is_named():
    with pytest.raises(UserError, match=r"missing required value for agents\[1\].model_path"):
        load_config(PPOConfig, None, ["agents=[{name: a, model_path: m}, {name: b}]"])


def test_agent_configs_and_pools():
    cfg = _cfg("agents=[{name: a, model_path: m1}, {name: b, model_path: m2, optim: {lr: 0.5}, "
               "world_size: 2, resource_pool: separate}, {name: c, model_path: m3}]",
               "agents.2.temperature=0.3", "trainer.output_dir=/tmp/run")
    check_agents(cfg)
    b = agent_config(cfg, cfg.agents[1], 1)
    assert b.actor.model_path == "m2" and b.actor.optim.lr == 0.5 and b.trainer.n_gpus_per_node == 2
    assert b.trainer.output_dir == "/tmp/run/agents/b" and b.rollout.seed != cfg.rollout.seed
    assert agent_config(cfg, cfg.agents[2], 2).rollout.temperature == 0.3
    assert agent_config(cfg, cfg.agents[0], 0).actor.optim.lr == cfg.actor.optim.lr
    assert agent_config(cfg, cfg.agents[0], 0).actor.ref_model_path is None  # its own start
    cfg.agents[0].reference_path, cfg.actor.ref_model_path = "r0", "shared_ref"
    assert agent_config(cfg, cfg.agents[0], 0).actor.ref_model_path == "r0"
    assert agent_config(cfg, cfg.agents[1], 1).actor.ref_model_path == "shared_ref"
    assert {k: [a.name for a in v] for k, v in pools(cfg.agents).items()} == {"shared": ["a", "c"],
                                                                       "agent-b": ["b"]}


def test_reward_models_of_the_agents_alone_are_a_reward():
    """No shared reward: each agent's own reward model is what scores it; an agent left with
    neither a reward model nor ``reward.fn`` is named."""
    from megatron_rlhf.config.ppo_checks import validate_ppo_config

    two = ["multi_agent.mode=critique-revise", "algorithm.adv_estimator=grpo", "rollout.n=2",
           "actor.policy_loss=vanilla", "reward.fn=null", "actor.model_path=m1"]
    cfg = _cfg(*two, "agents.0.reward_model_path=rm_a", "agents.1.reward_model_path=rm_b")
    validate_ppo_config(cfg)
    for i, agent in enumerate(cfg.agents):
        validate_ppo_config(agent_config(cfg, agent, i))
    cfg = _cfg(*two, "agents.0.reward_model_path=rm_a")
    with pytest.raises(UserError, match="set reward.model_path"):
        validate_ppo_config(agent_config(cfg, cfg.agents[1], 1))


@pytest.mark.parametrize("mode,overrides,expected", [
    ("population", [], {}),  # rule-based rewards alone: no judge
    ("population", ["reward.model_path=rm"], {"rm": ["a", "b"]}),
    ("critique-revise", ["reward.model_path=rm", "agents.1.reward_model_path=rm_b"],
     {"rm": ["a"], "rm_b": ["b"]}),
    ("critique-revise", ["agents.0.reward_model_path=rm_a"], {"rm_a": ["a"]}),
    # The proposer is scored by learnability: the shared reward model judges the solver alone.
    ("proposer-solver", ["reward.model_path=rm"], {"rm": ["b"]}),
])
def test_each_distinct_reward_model_gets_one_judge(mode, overrides, expected):
    extra = [] if mode == "population" else ["algorithm.adv_estimator=grpo", "actor.policy_loss=vanilla"]
    cfg = _cfg(f"multi_agent.mode={mode}", *extra, *overrides)
    check_agents(cfg)
    assert judges(cfg) == expected
    for i, agent in enumerate(cfg.agents):
        scoring = [path for path, names in expected.items() if agent.name in names]
        assert agent_config(cfg, agent, i).reward.model_path == (scoring[0] if scoring else None)


# ---------------------------------------------------------------------------- scripted agents
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from megatron_rlhf.models.tiny import train_tokenizer

    texts = [f"What is {a} + {b}? The answer is {a + b}. Check this answer. Final answer:"
             for a in range(10) for b in range(10)]
    return train_tokenizer(texts, tmp_path_factory.mktemp("tok"), vocab_size=300)


class Scripted:
    """An agent whose replies are a function of the prompt text; records what it was shown."""

    def __init__(self, tokenizer, reply, score=None, prompts=None, reward_model=None):
        from types import SimpleNamespace

        self.tokenizer, self.reply, self.score_fn = tokenizer, reply, score
        self.prompts, self.seen, self.pad_id = prompts or [], [], tokenizer.pad_token_id
        self.val, self.scored_calls = [], 0
        self.cfg = SimpleNamespace(reward=SimpleNamespace(model_path=reward_model))

    def step_prompts(self, step):
        return self.prompts

    def sampling(self, step):
        from megatron_rlhf.rollout.base import SamplingParams

        return SamplingParams(max_tokens=8, n=2, seed=step)

    def _generate_ids(self, ids, params, release=False):
        out = []
        for index, prompt in enumerate(ids):
            text = self.tokenizer.decode(prompt, skip_special_tokens=True)
            self.seen.append(text)
            for _ in range(params.n):  # the reply's k: this call's sample count so far
                tokens = self.tokenizer(self.reply(text, len(out)), add_special_tokens=False)["input_ids"]
                out.append(Generation(index, tokens, [-0.5] * len(tokens), True))
        return out

    def generate(self, prompts, params, turns=1):
        return self._generate_ids([list(p.ids) for p in prompts], params)

    def pop_tool_metrics(self):
        return {}  # no tools

    def scores(self, prompts, gens, batch):
        from megatron_rlhf.trainers.rl.agent import _last_turn

        texts = [self.tokenizer.decode(_last_turn(g), skip_special_tokens=True) for g in gens]
        values = torch.tensor([self.score_fn(t, prompts[g.prompt_index]) for t, g in zip(texts, gens)])
        self.scored_calls += 1
        return {"score": values, "rm": None, "turns": None, "oracle": values}

    def oracle_scores(self, prompts, gens):
        return torch.tensor([float(_right(self.tokenizer.decode(g.tokens, skip_special_tokens=True),
                                          prompts[g.prompt_index])) for g in gens])


class Run:
    def __init__(self, cfg, agents):
        self.cfg, self.agents = cfg, agents


def _prompt(tokenizer, text, truth=None):
    from megatron_rlhf.trainers.rl.modes import _user_prompt

    return _user_prompt(tokenizer, text, truth)


def _right(text, prompt):
    from megatron_rlhf.data.tasks import check_answer

    return check_answer(text, prompt.ground_truth)


def test_population_shares_one_table_and_scores_against_everyone(tokenizer):
    prompts = [_prompt(tokenizer, f"What is {a} + 1?", str(a + 1)) for a in range(3)]
    # a is always right, b right on its first sample only: a beats b, b's first ties a.
    a = Scripted(tokenizer, lambda t, k: f"The answer is {int(t.split()[2]) + 1}.", _right, prompts)
    b = Scripted(tokenizer, lambda t, k: f"The answer is {int(t.split()[2]) + 1 + k % 2}.", _right,
                 prompts)
    cfg = _cfg()
    episodes, metrics = Population().play(Run(cfg, {"a": a, "b": b}), 0, Timer())
    table = episodes["a"].population["preferences"]
    assert table is episodes["b"].population["preferences"]  # one table, computed once
    assert "preferences" not in episodes["a"].batch  # it travels with the update alone
    assert torch.equal(table, 1.0 - table.T)
    scores = torch.cat([episodes[n].scored["score"] for n in "ab"])
    assert torch.equal(table, pairwise_preferences(scores, "rule"))
    rates = win_rates(table, episodes["a"].population["population_group"])
    for name, rows in (("a", range(0, 6)), ("b", range(6, 12))):
        ep = episodes[name]
        assert ep.population["population_rows"].tolist() == list(rows)
        per_sample = (ep.advantages * ep.batch["loss_mask"]).sum(1) / ep.batch["loss_mask"].sum(1)
        assert torch.allclose(per_sample, rates[list(rows)] - 0.5)
    # By hand: each of a's samples meets a's other (tie), b's right one (tie) and b's wrong one
    # (win): (0.5 + 0.5 + 1) / 3.
    assert torch.allclose(rates[:6], torch.full((6,), 2 / 3))
    assert metrics["population/win_rate/a/b"] == pytest.approx(0.75)
    assert metrics["population/win_rate/b/a"] == pytest.approx(0.25)


def test_proposer_solver_feeds_valid_tasks_and_rewards_learnability(tokenizer):
    cfg = _cfg("multi_agent.mode=proposer-solver", "algorithm.adv_estimator=grpo",
               "actor.policy_loss=vanilla", "data.train_batch_size=6")
    proposals = ["What is 2 + 3?", "no numbers here", "What is 4 + 4?", "What is 5 + 1?",
                 "What is 9 + 9?", "What is 20 + 1?"]
    proposer = Scripted(tokenizer, lambda t, k: proposals[k])
    # The solver gets 2+3 always right, 4+4 right once in two, 5+1 never.
    answers = {"2 + 3": ["5", "5"], "4 + 4": ["8", "7"], "5 + 1": ["0", "0"]}
    solver = Scripted(tokenizer, lambda t, k: f"The answer is {answers[t.split('is ')[1][:5]][k % 2]}.",
                      _right)
    solver.val = [_prompt(tokenizer, "What is 9 + 9?", "18")]  # held out: never a task
    mode = ProposerSolver(cfg, ["p", "s"])
    episodes, metrics = mode.play(Run(cfg, {"p": proposer, "s": solver}), 0, Timer())
    # Invalid: no numbers, a held-out question, an operand over multi_agent.task_high (19).
    assert metrics["proposer/valid_fraction"] == 0.5
    asked = [t for t in solver.seen]
    assert len(asked) == 6 and all("What is" in t for t in asked)  # 3 valid tasks fill 6 slots
    assert asked[3:] == asked[:3]  # valid tasks repeat in the invalid ones' slots
    truths = [p.ground_truth for p in episodes["s"].prompts]
    assert truths == ["5", "8", "6", "5", "8", "6"]
    # learnability per proposal: 2+3 solved at 1 -> 0; invalid -> 0; 4+4 at 1/2 -> 1; 5+1 at 0 -> 0
    assert episodes["p"].scored["score"].tolist() == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert episodes["p"].batch["input_ids"].shape[0] == 6 and len(proposer.seen) == 6
    assert episodes["p"].batch["group"].tolist() == [0] * 6  # one instruction, one baseline


def test_critique_revise_masks_each_agents_tokens(tokenizer):
    cfg = _cfg("multi_agent.mode=critique-revise", "algorithm.adv_estimator=grpo",
               "actor.policy_loss=vanilla")
    prompts = [_prompt(tokenizer, "What is 2 + 3?", "5")]

    def answerer(text, k):  # first a wrong answer; after a critique, the right one
        return "The answer is 5." if "Final answer:" in text else "The answer is 6."

    a = Scripted(tokenizer, answerer, _right, prompts)
    b = Scripted(tokenizer, lambda t, k: "wrong", _right)
    mode = CritiqueRevise(cfg, ["a", "b"])
    episodes, metrics = mode.play(Run(cfg, {"a": a, "b": b}), 0, Timer())
    assert metrics == {"critique/first_answer_acc": 0.0, "critique/final_answer_acc": 1.0}
    mine, theirs = episodes["a"], episodes["b"]
    assert "The answer is 6. Check this answer." in b.seen[0]  # the critic read the answer
    assert "wrong Final answer:" in a.seen[-1]  # the answerer read the critique
    ids, mask = mine.batch["input_ids"][0], mine.batch["loss_mask"][0]
    # The answerer's loss covers its two replies and nothing of the critic's or the prompts'.
    trained = tokenizer.decode(ids[1:][mask[:-1] > 0].tolist())
    assert trained == "The answer is 6.The answer is 5."
    critic_trained = tokenizer.decode(theirs.batch["input_ids"][0][1:][theirs.batch["loss_mask"][0][:-1] > 0].tolist())
    assert critic_trained == "wrong"
    assert mine.scored["score"].tolist() == [1.0, 1.0] == theirs.scored["score"].tolist()
    assert theirs.batch["group"].tolist() == [0, 0]  # the critic's baseline: per question
    assert (a.scored_calls, b.scored_calls) == (1, 0)  # one judge: the final answers scored once


def test_critique_revise_scores_each_agent_with_its_own_reward_model(tokenizer):
    """The critic with a reward model of its own is scored by it, on the answerer's final
    answers (the same text the answerer's reward model judges), not by the answerer's."""
    cfg = _cfg("multi_agent.mode=critique-revise", "algorithm.adv_estimator=grpo",
               "actor.policy_loss=vanilla")
    prompts = [_prompt(tokenizer, "What is 2 + 3?", "5")]
    judged = []

    def length(text, prompt):  # the critic's "reward model": the final answer's length
        judged.append(text)
        return float(len(text))

    a = Scripted(tokenizer, lambda t, k: "The answer is 5." if "Final answer:" in t else "6",
                 _right, prompts, reward_model="rm_a")
    b = Scripted(tokenizer, lambda t, k: "wrong", length, reward_model="rm_b")
    episodes, metrics = CritiqueRevise(cfg, ["a", "b"]).play(Run(cfg, {"a": a, "b": b}), 0, Timer())
    assert episodes["a"].scored["score"].tolist() == [1.0, 1.0]
    assert episodes["b"].scored["score"].tolist() == [16.0, 16.0]
    assert judged == ["The answer is 5."] * 2  # the final answer alone
    assert metrics["critique/first_answer_acc"] == 0.0


class Saved:
    """A PPORun's checkpoint bookkeeping, without workers."""

    def __init__(self, steps, cfg):
        from megatron_rlhf.algorithms.ppo import FixedKLController

        self.steps, self.restored, self.cfg = steps, None, cfg
        self.rollbacks, self.lr_scale, self.kl_loss_scale = 0, 1.0, 1.0
        self.kl_ctrl = FixedKLController(0.1)

    lower_rates = PPORun.lower_rates  # the arithmetic under test is PPORun's own

    def checkpoints(self):
        return sorted(self.steps)

    def restore(self, step, keep_scales=False):
        self.restored = (step, keep_scales)

    def prune(self, keep):
        self.steps &= keep


def test_a_bad_step_in_one_agent_rolls_every_agent_back_to_their_common_step(tmp_path, capsys):
    from megatron_rlhf.trainers.rl.run import RLRun as MultiAgentRun

    cfg = _cfg(f"trainer.output_dir={tmp_path}", "trainer.rollback.max_rollbacks=1")
    agents = {"a": Saved({2, 4, 6}, cfg), "b": Saved({2, 4}, cfg)}  # killed before b saved step 6
    run = MultiAgentRun(cfg, agents, Population(), total_steps=10, step=6)
    assert run.checkpoints() == [2, 4]
    run.rollback("b", "actor/pg_loss is nan")
    assert run.step == 4
    assert "rollback 1/1 at step 7: agent b: actor/pg_loss is nan; every agent restored to step 4" \
        in capsys.readouterr().out
    for agent in agents.values():
        assert agent.restored == (4, True) and agent.rollbacks == 1
        assert agent.lr_scale == cfg.trainer.rollback.lr_factor
        assert agent.kl_ctrl.value == pytest.approx(0.1 * cfg.trainer.rollback.kl_coef_factor)
    with pytest.raises(UserError, match="agent a: loss is inf; already rolled back 1 times"):
        run.rollback("a", "loss is inf")
    empty = MultiAgentRun(cfg, {"a": Saved(set(), cfg), "b": Saved({2}, cfg)}, Population(), 10, step=3)
    with pytest.raises(UserError, match="no checkpoint to roll back to"):
        empty.rollback("a", "loss is nan")


def test_a_step_that_fails_again_steps_back_one_restore_point_each_time(tmp_path, capsys):
    """Run 4 of docs/smollm2.md: the newest checkpoint was itself past the KL threshold, so six
    replays from it failed alike. A repeat failure of the same step goes one restore point further
    back and deletes the rejected newer ones (a later rollback or a resume must not land there)."""
    from megatron_rlhf.trainers.rl.run import RLRun

    cfg = _cfg(f"trainer.output_dir={tmp_path}", "trainer.rollback.max_rollbacks=9")
    agents = {"a": Saved({2, 4, 6}, cfg), "b": Saved({2, 4, 6}, cfg)}
    run = RLRun(cfg, agents, Population(), total_steps=20, step=6)
    run.rollback("a", "actor/kl 0.09 exceeds")
    assert run.step == 6 and agents["a"].steps == {2, 4, 6}  # first time: the newest
    run.rollback("a", "actor/kl 0.08 exceeds")
    assert run.step == 4 and all(a.steps == {2, 4} and a.restored == (4, True) for a in agents.values())
    assert "step 7 failed 2 times in a row: stepped back past step(s) 6, deleted" in capsys.readouterr().out
    for agent in agents.values():  # the replay of steps 5 and 6 saved step 6 anew
        agent.steps.add(6)
    run.step = 6
    run.rollback("b", "actor/kl 0.07 exceeds")  # step 7 a third time: two points back
    assert run.step == 2 and agents["b"].steps == {2}
    run.step = 3
    run.rollback("b", "actor/kl 0.07 exceeds")  # another step: the newest (and only) one
    run.rollback("b", "actor/kl 0.07 exceeds")  # no older point left: the oldest again
    assert run.step == 2 and agents["a"].rollbacks == 5
    assert agents["a"].lr_scale == pytest.approx(cfg.trainer.rollback.lr_factor ** 5)


def test_the_workers_targets_come_from_the_table_row_by_row():
    """What every rank trains on: ``population_advantages`` turns the shared table into this
    agent's samples' targets (win rate against all samples of the prompt, minus 1/2)."""
    import hashlib

    from megatron_rlhf.trainers.rl.worker import population_advantages

    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(12, generator=gen)
    groups = torch.tensor([0, 0, 1, 1, 2, 2] * 2)  # two agents x 3 prompts x 2 samples
    table = pairwise_preferences(scores, "bradley_terry")
    mask = torch.ones(6, 5)
    batch = {"loss_mask": mask, "preferences": table, "population_group": groups,
             "population_rows": torch.arange(6, 12)}
    digest = population_advantages(batch)
    assert digest == hashlib.sha256(table.numpy().tobytes()).hexdigest()
    assert not {"preferences", "population_group", "population_rows"} & set(batch)
    for row in range(6):
        i = 6 + row
        others = [j for j in range(12) if j != i and groups[j] == groups[i]]
        expected = sum(float(table[i, j]) for j in others) / len(others) - 0.5
        assert torch.allclose(batch["advantages"][row], torch.full((5,), expected), atol=1e-6)
    assert torch.equal(batch["returns"], batch["advantages"])
