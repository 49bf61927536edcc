"""Play modes: who speaks when, what each agent sees, and what each is scored on.

``solo`` (one agent, or several trained side by side) lets each agent roll out on its own, with
everything plain PPO does: dynamic sampling, offline samples, multi-turn. The others decide the
conversation themselves.

A mode's :meth:`play` returns one :class:`Episode` per agent that trains this step: its samples
as a PPO batch, each sample's score, and (population) the step's preference table. The
driver turns episodes into updates the same way for every mode.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol

import torch

from megatron_rlhf.algorithms.multi_agent import agent_win_matrix, learnability
from megatron_rlhf.algorithms.sppo import pairwise_preferences, win_rates
from megatron_rlhf.data.chat import as_messages, render_prompt
from megatron_rlhf.data.prompts import Prompt
from megatron_rlhf.data.tasks import AdditionTask, parse_question
from megatron_rlhf.rollout.base import Generation
from megatron_rlhf.trainers.rl.experience import Experience, build_batch, sppo_preference


@dataclass
class Episode:
    """One agent's share of a step: ``gens`` of ``prompts``, as ``batch``, scored (``scored``:
    ``score [N]``, ``rm``, ``turns``, ``oracle``). ``advantages [N, T]``: set by modes whose
    targets are not a per-agent function of the scores (population)."""

    prompts: list[Prompt]
    gens: list[Generation]
    batch: Experience
    scored: dict
    advantages: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    population: dict = field(default_factory=dict)
    """population: ``preferences [M, M]``, ``population_group [M]``, ``population_rows [N]``,
    sent with the update only (the workers derive the targets from them)."""


class PlayMode(Protocol):
    def play(self, run, step: int, timer) -> tuple[dict[str, Episode], dict[str, float]]:
        """(episodes by agent name, the step's mode-level metrics)."""

    def validated(self, run) -> list[str]:
        """Agents whose policy answers ``data.val_files`` (the task's held-out questions)."""


class Solo:
    """Each agent generates and is scored on its own prompts, as one PPO run would
    (:meth:`~megatron_rlhf.trainers.rl.agent.PPORun.rollout`)."""

    def play(self, run, step: int, timer):
        episodes = {}
        for name, agent in run.agents.items():
            clock = timer if run.single else _Named(timer, name)
            prompts, gens, batch, scored, sampled = agent.rollout(step, clock)
            episodes[name] = Episode(prompts, gens, batch, scored, metrics=sampled)
        return episodes, {}

    def validated(self, run) -> list[str]:
        return list(run.agents)


class _Named:
    """``timer`` whose phases carry an agent's name (``timing/gen/<name>``)."""

    def __init__(self, timer, name: str):
        self.timer, self.name = timer, name

    def __call__(self, what: str):
        return self.timer(f"{what}/{self.name}")


def _episode(agent, prompts: list[Prompt], gens: list[Generation]) -> Episode:
    batch = build_batch([p.ids for p in prompts], gens, agent.pad_id)
    return Episode(prompts, gens, batch, agent.scores(prompts, gens, batch))


class Population:
    """Every agent answers every prompt (``rollout.n`` samples each); the preference model
    compares every pair of samples of a prompt, across agents and within each; each agent's
    target is its samples' win rate against the whole population (multi-agent SPPO)."""

    def play(self, run, step: int, timer):
        names = list(run.agents)
        prompts = run.agents[names[0]].step_prompts(step)
        episodes = {}
        for name in names:
            agent = run.agents[name]
            with timer(f"gen/{name}"):
                gens = agent.generate(prompts, agent.sampling(step))
            with timer(f"reward/{name}"):
                episodes[name] = _episode(agent, prompts, gens)
            episodes[name].metrics |= agent.pop_tool_metrics()
        first = episodes[names[0]]
        scores = torch.cat([episodes[n].scored["score"] for n in names])
        groups = torch.cat([episodes[n].batch["group"] for n in names])
        owners = torch.cat([torch.full((len(episodes[n].gens),), k) for k, n in enumerate(names)])
        # Computed once, here: every agent's workers receive this very table.
        table = pairwise_preferences(scores, sppo_preference(run.cfg.algorithm, first.batch))
        rates, offset = win_rates(table, groups), 0
        for name in names:
            episode = episodes[name]
            rows = torch.arange(offset, offset + len(episode.gens))
            offset += len(episode.gens)
            episode.population = {"preferences": table, "population_group": groups,
                                  "population_rows": rows}
            episode.advantages = (rates[rows] - 0.5)[:, None] * episode.batch["loss_mask"]
            episode.metrics["population/win_rate"] = float(rates[rows].mean())
        matrix = agent_win_matrix(table, groups, owners, len(names))
        metrics = {f"population/win_rate/{a}/{b}": float(matrix[i, j])
                   for i, a in enumerate(names) for j, b in enumerate(names) if i != j}
        return episodes, metrics

    def validated(self, run) -> list[str]:
        return list(run.agents)


def _user_prompt(tokenizer, text: str, ground_truth: str | None = None) -> Prompt:
    return Prompt(tuple(render_prompt(tokenizer, as_messages(text, "user"))), ground_truth, text)


def _by_prompt(values: torch.Tensor, gens: list[Generation], count: int) -> torch.Tensor:
    """Mean of per-sample ``values [N]`` over each prompt's samples -> ``[count]``."""
    index = torch.tensor([g.prompt_index for g in gens])
    sums = torch.zeros(count).index_add_(0, index, values.float())
    return sums / torch.bincount(index, minlength=count).clamp(min=1)


class ProposerSolver:
    """The proposer writes ``data.train_batch_size`` tasks a step (one prompt,
    ``multi_agent.proposer_prompt``); those that parse as a task of the family become the
    solver's prompts (``rollout.n`` samples each, checked by ``reward.fn`` against the task's
    own answer). The solver is rewarded for correct answers; the proposer, per task, by
    :func:`learnability` of the solver's solve rate (0 for a task that does not parse)."""

    def __init__(self, cfg, names: list[str]):
        m = cfg.multi_agent
        self.proposer = m.proposer or names[0]
        self.solver = next(n for n in names if n != self.proposer)
        self.task = AdditionTask(high=m.task_high)

    def play(self, run, step: int, timer):
        proposer, solver = run.agents[self.proposer], run.agents[self.solver]
        count = run.cfg.data.train_batch_size
        ask = _user_prompt(proposer.tokenizer, run.cfg.multi_agent.proposer_prompt)
        with timer(f"gen/{self.proposer}"):  # count copies, not n=count: every replica writes some
            proposals = proposer.generate([ask] * count, dataclasses.replace(proposer.sampling(step), n=1))
        proposals = sorted(proposals, key=lambda g: g.prompt_index)
        texts = [proposer.tokenizer.decode(g.tokens, skip_special_tokens=True) for g in proposals]
        # A held-out question is no task: the solver's held-out solve rate must stay held out.
        held_out = {p.text for p in solver.val}
        tasks = [parse_question(t, self.task) for t in texts]
        tasks = [t if t is not None and AdditionTask.question(*t)[0] not in held_out else None
                 for t in tasks]
        valid = [i for i, t in enumerate(tasks) if t is not None]
        metrics = {"proposer/valid_fraction": len(valid) / count}
        rates = torch.zeros(count)
        episodes = {}
        if valid:
            # Every solver slot gets a proposed task (valid ones repeat to fill the step), so
            # the solver's batch keeps the size its layout divides.
            slots = [valid[k % len(valid)] for k in range(count)]
            questions = [_user_prompt(solver.tokenizer, AdditionTask.question(*tasks[i])[0],
                                      str(sum(tasks[i]))) for i in slots]
            with timer(f"gen/{self.solver}"):
                gens = solver.generate(questions, solver.sampling(step))
            with timer(f"reward/{self.solver}"):
                episodes[self.solver] = _episode(solver, questions, gens)
            solved = episodes[self.solver].scored.get("oracle", episodes[self.solver].scored["score"])
            per_slot = _by_prompt(solved, gens, count)
            for i in valid:
                rates[i] = per_slot[torch.tensor([s == i for s in slots])].mean()
            metrics["solver/solve_rate"] = float(per_slot.mean())
        is_valid = torch.zeros(count, dtype=torch.bool)
        is_valid[valid] = True
        score = learnability(rates, is_valid)
        batch = build_batch([ask.ids] * count, proposals, proposer.pad_id)
        batch["group"] = torch.zeros(count, dtype=torch.long)  # one instruction: one group
        episodes[self.proposer] = Episode([ask] * count, proposals, batch,
                                          {"score": score, "rm": None, "turns": None})
        metrics["proposer/learnability_mean"] = float(score.mean())
        if valid:
            metrics["proposer/distinct_tasks"] = float(len({tasks[i] for i in valid}))
        return episodes, metrics

    def validated(self, run) -> list[str]:
        return [self.solver]


class CritiqueRevise:
    """The answerer answers (``rollout.n`` samples a prompt); the critic reads the prompt, the
    answer and ``multi_agent.critique_prompt`` and writes a critique; the answerer reads it all
    and ``multi_agent.revise_prompt`` and writes its final answer, which ``reward.fn`` (and/or
    the reward model) scores. Both agents get that score, each on its own tokens only: the
    answerer's sample masks the critique out, the critic's sample is its critique alone. An agent
    with a reward model of its own is scored by it on the same final answers."""

    def __init__(self, cfg, names: list[str]):
        self.answerer = cfg.multi_agent.answerer or names[0]
        self.critic = next(n for n in names if n != self.answerer)

    def play(self, run, step: int, timer):
        answerer, critic = run.agents[self.answerer], run.agents[self.critic]
        m, tok = run.cfg.multi_agent, answerer.tokenizer
        prompts = answerer.step_prompts(step)
        critique_ids = tok(m.critique_prompt, add_special_tokens=False)["input_ids"]
        revise_ids = tok(m.revise_prompt, add_special_tokens=False)["input_ids"]
        with timer(f"gen/{self.answerer}"):
            answers = answerer.generate(prompts, answerer.sampling(step))
        seen = [list(prompts[g.prompt_index].ids) + g.tokens + critique_ids for g in answers]
        one = dataclasses.replace(answerer.sampling(step), n=1)
        with timer(f"gen/{self.critic}"):
            critiques = _in_order(critic._generate_ids(seen, dataclasses.replace(
                critic.sampling(step), n=1), release=True))
        final_prompts = [s + c.tokens + revise_ids for s, c in zip(seen, critiques)]
        with timer(f"gen/{self.answerer}"):
            finals = _in_order(answerer._generate_ids(final_prompts, one, release=True))
        joined = []
        for a, c, f in zip(answers, critiques, finals):
            between = len(critique_ids) + len(c.tokens) + len(revise_ids)
            joined.append(Generation(
                a.prompt_index, a.tokens + critique_ids + c.tokens + revise_ids + f.tokens,
                a.logprobs + [0.0] * between + f.logprobs, f.finished,
                mask=[1] * len(a.tokens) + [0] * between + [1] * len(f.tokens),
                routing=f.routing))  # the final call read the whole context: its routing covers it
        with timer(f"reward/{self.answerer}"):
            # The final answer alone, after the question, is what is scored (a reward model
            # never sees the critique; a length penalty counts the final turn).
            final = [Generation(a.prompt_index, f.tokens, f.logprobs, f.finished)
                     for a, f in zip(answers, finals)]
            scored = _episode(answerer, prompts, final).scored
        batch = build_batch([p.ids for p in prompts], joined, answerer.pad_id)
        mine = Episode(prompts, joined, batch, scored)
        critic_prompts = [Prompt(tuple(s), prompts[a.prompt_index].ground_truth,
                                 prompts[a.prompt_index].text) for s, a in zip(seen, answers)]
        critic_gens = [Generation(row, c.tokens, c.logprobs, c.finished, routing=c.routing)
                       for row, c in enumerate(critiques)]
        critic_batch = build_batch([p.ids for p in critic_prompts], critic_gens, critic.pad_id)
        critic_batch["group"] = torch.tensor([a.prompt_index for a in answers])  # per question
        if critic.cfg.reward.model_path == answerer.cfg.reward.model_path:  # the same judge
            theirs_scored = dict(scored)
        else:  # the critic's own reward model judges the same final answers
            with timer(f"reward/{self.critic}"):
                theirs_scored = _episode(critic, prompts, final).scored
        theirs = Episode(critic_prompts, critic_gens, critic_batch, theirs_scored)
        metrics = {}
        if mine.scored.get("oracle") is not None:
            metrics = {"critique/first_answer_acc": float(answerer.oracle_scores(prompts, answers).mean()),
                       "critique/final_answer_acc": float(mine.scored["oracle"].mean())}
        return {self.answerer: mine, self.critic: theirs}, metrics

    def validated(self, run) -> list[str]:
        return [self.answerer]


def _in_order(gens: list[Generation]) -> list[Generation]:
    return sorted(gens, key=lambda g: g.prompt_index)


def make_mode(cfg, names: list[str]) -> PlayMode:
    mode = cfg.multi_agent.mode
    if mode == "solo":
        return Solo()
    if mode == "population":
        return Population()
    if mode == "proposer-solver":
        return ProposerSolver(cfg, names)
    return CritiqueRevise(cfg, names)
