"""DAPO's dynamic sampling (``algorithm.filter_groups``): one step's rollout in rounds.

Round 1 generates the step's own prompts. A group (one prompt's ``rollout.n`` samples) whose
scores are all equal has zero advantage under a group baseline and only dilutes the batch, so
it is set aside; each further round draws ``ceil(oversample * missing)`` fresh prompts (seeded
by step and round, so a resumed run draws the same) until ``data.train_batch_size`` groups with
signal are in hand or ``max_rounds`` is spent. The step's batch always holds
``train_batch_size`` groups (the layout's batch arithmetic stays fixed): the first groups with
signal, then, when the rounds ran out, groups set aside, which ``train_rows`` leaves out of the
loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from megatron_rlhf.algorithms.dapo import groups_with_signal
from megatron_rlhf.trainers.rl.experience import build_batch

_PER_SAMPLE = ("score", "rm", "oracle", "overlong_penalty")


@dataclass
class Group:
    prompt: object  # data.prompts.Prompt
    gens: list  # its rollout.n Generations
    scored: dict  # per-sample rows of the scores dict (keys of _PER_SAMPLE present)


def split_groups(prompts: list, gens: list, scored: dict, signal: torch.Tensor):
    """One round's samples as (groups with signal, groups without), prompts in order."""
    kept, dropped = [], []
    for index, prompt in enumerate(prompts):
        rows = [row for row, g in enumerate(gens) if g.prompt_index == index]
        if not rows:
            continue
        part = {k: scored[k][rows] for k in _PER_SAMPLE if scored.get(k) is not None}
        group = Group(prompt, [gens[row] for row in rows], part)
        (kept if bool(signal[rows[0]]) else dropped).append(group)
    return kept, dropped


def assemble(groups: list[Group], trained: int, pad_id: int):
    """(prompts, generations, batch, scores) of ``groups``; the first ``trained`` are trained
    on (``batch["train_rows"]``), the rest are masked out of the loss."""
    prompts, gens, train_rows = [], [], []
    for index, group in enumerate(groups):
        prompts.append(group.prompt)
        gens += [replace(g, prompt_index=index) for g in group.gens]
        train_rows += [index < trained] * len(group.gens)
    batch = build_batch([p.ids for p in prompts], gens, pad_id)
    batch["train_rows"] = torch.tensor(train_rows)
    batch["scores_from_rm"] = "rm" in groups[0].scored
    scored = {"rm": None, "turns": None}
    for key in _PER_SAMPLE:
        if key in groups[0].scored:
            scored[key] = torch.cat([g.scored[key] for g in groups])
    return prompts, gens, batch, scored


def rollout_with_signal(run, step: int, timer):
    """The step's rollout under dynamic sampling: (prompts, gens, batch, scores, metrics)."""
    f, target = run.cfg.algorithm.filter_groups, run.cfg.data.train_batch_size
    indices = run.step_indices(step)
    used, kept, dropped, rounds = set(indices), [], [], 0
    while True:
        prompts = [run.train[i] for i in indices]
        params = run.sampling(step)
        with timer("gen"):
            gens = run.generate(prompts, replace(params, seed=params.seed + 7919 * rounds))
        batch = build_batch([p.ids for p in prompts], gens, run.pad_id)
        with timer("reward_values"):
            scored = run.scores(prompts, gens, batch)
        rounds += 1
        good, bad = split_groups(prompts, gens, scored, groups_with_signal(scored[f.metric],
                                                                           batch["group"]))
        kept, dropped = kept + good, dropped + bad
        if len(kept) >= target or rounds >= f.max_rounds:
            break
        indices = run.extra_indices(step, rounds, math.ceil(f.oversample * (target - len(kept))),
                                    used)
        if not indices:  # every prompt of the data set was tried this step
            break
        used.update(indices)
    trained = min(len(kept), target)
    prompts, gens, batch, scored = assemble(kept[:trained] + dropped[:target - trained], trained,
                                            run.pad_id)
    batch["values"] = None  # group baselines only (checked at start-up)
    metrics = {"dapo/rounds": rounds, "dapo/kept_groups": len(kept),
               "dapo/dropped_groups": len(dropped), "dapo/trained_groups": trained}
    if trained < target:
        run.log(f"step {step + 1}: {trained} of {target} groups had signal after {rounds} rounds "
                f"(algorithm.filter_groups.max_rounds); training on those")
    return prompts, gens, batch, scored, metrics
