"""``agents:`` and ``multi_agent:``: start-up checks, and each agent's own PPO config."""

from __future__ import annotations

import copy
import re
from pathlib import Path

from megatron_rlhf.algorithms.estimators import estimator
from megatron_rlhf.config.ppo_schema import AgentConfig, PPOConfig
from megatron_rlhf.errors import UserError

MODES = ("solo", "population", "proposer-solver", "critique-revise")
TASKS = ("addition",)
_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


def check_agents(cfg: PPOConfig) -> None:
    """Everything about ``agents`` and ``multi_agent`` that needs no model; errors name the key."""
    agents, m = cfg.agents, cfg.multi_agent
    seen = set()
    for i, agent in enumerate(agents):
        if not _NAME.match(agent.name):
            raise UserError(f"config: agents[{i}].name={agent.name!r} must be letters, digits, "
                            "'_' or '-' (it names folders and metrics)")
        if agent.name in seen:
            raise UserError(f"config: agents[{i}].name={agent.name!r} clashes with an earlier "
                            "agent; agent names must be unique")
        seen.add(agent.name)
        if not agent.model_path:
            raise UserError(f"config: agents[{i}] ({agent.name}) has no model_path")
        if agent.world_size < 1:
            raise UserError(f"config: agents[{i}].world_size={agent.world_size} must be >= 1")
    if m.mode not in MODES:
        raise UserError(f"config: multi_agent.mode={m.mode!r} must be one of {', '.join(MODES)}")
    for key in ("proposer", "answerer"):
        name = getattr(m, key)
        if name is not None and name not in seen:
            raise UserError(f"config: multi_agent.{key}={name!r} is not an agent "
                            f"({', '.join(sorted(seen))})")
    _check_mode(cfg)


def _check_mode(cfg: PPOConfig) -> None:
    m, alg, r = cfg.multi_agent, cfg.algorithm, cfg.reward
    if len(cfg.agents) > 1 and cfg.resource_pool.critic == "separate":
        raise UserError("config: resource_pool.critic=separate places one critic group apart, for "
                        "one agent; with several agents each agent's critic sits in its own group")
    if m.mode == "solo":
        return  # each agent rolls out on its own, as one PPO run: everything PPO does
    if len(cfg.agents) < 2:
        raise UserError(f"config: multi_agent.mode={m.mode} plays two or more agents; agents lists "
                        f"{len(cfg.agents)} (one agent trains alone: multi_agent.mode=solo)")
    # These change who generates what, which the mode decides itself.
    unsupported = [(alg.filter_groups.enable, "algorithm.filter_groups.enable"),
                   (cfg.data.offline_fraction > 0, "data.offline_fraction"),
                   (cfg.rollout.max_turns > 1, "rollout.max_turns"),
                   # Population: every agent answers the dataset's prompts, tools and all. The
                   # two-player modes write their own prompts and turns (not built with tools).
                   (bool(cfg.rollout.tools or cfg.rollout.tools_file) and m.mode != "population",
                    "rollout.tools")]
    for bad, key in unsupported:
        if bad:
            raise UserError(f"config: {key} is not supported with multi_agent.mode={m.mode} (the "
                            "mode decides who generates what; multi_agent.mode=solo supports it)")
    if m.mode == "population":
        if alg.adv_estimator != "sppo":
            raise UserError("config: multi_agent.mode=population trains every agent with SPPO against "
                            "the population: set algorithm.adv_estimator=sppo and actor.policy_loss=sppo")
        if alg.sppo_target != "win_rate":
            raise UserError(f"config: multi_agent.mode=population regresses onto win rates against "
                            f"the population; algorithm.sppo_target={alg.sppo_target} is for one "
                            "policy")
        if alg.use_kl_in_reward:
            raise UserError("config: multi_agent.mode=population regresses onto win rates; "
                            "algorithm.use_kl_in_reward has no score to enter (use actor.use_kl_loss)")
    else:
        if len(cfg.agents) != 2:
            raise UserError(f"config: multi_agent.mode={m.mode} plays two agents; agents lists "
                            f"{len(cfg.agents)}")
        if alg.adv_estimator == "sppo":
            raise UserError(f"config: multi_agent.mode={m.mode} scores each agent on its own; use a "
                            "group baseline (algorithm.adv_estimator=grpo, rloo, ...), not sppo")
    if m.mode == "proposer-solver":
        if m.task not in TASKS:
            raise UserError(f"config: multi_agent.task={m.task!r} must be one of {', '.join(TASKS)}")
        if not r.fn:
            raise UserError("config: multi_agent.mode=proposer-solver checks answers with reward.fn "
                            "(e.g. reward.fn=addition)")
    _check_judges(cfg)
    if m.judge_world_size < 1:
        raise UserError(f"config: multi_agent.judge_world_size={m.judge_world_size} must be >= 1")


def _check_judges(cfg: PPOConfig) -> None:
    """Per-agent reward models where the mode can use them."""
    m = cfg.multi_agent
    paths = {reward_model(cfg, a) for a in cfg.agents}
    if m.mode == "population" and len(paths) > 1:
        raise UserError("config: multi_agent.mode=population compares every agent's samples in one "
                        "preference table, which needs one preference model; agents name "
                        f"{len(paths)} reward models ({', '.join(sorted(map(str, paths)))}): use "
                        "reward.model_path alone")
    if m.mode == "proposer-solver":
        proposer = m.proposer or cfg.agents[0].name
        for i, agent in enumerate(cfg.agents):
            if agent.name == proposer and agent.reward_model_path:
                raise UserError(f"config: agents[{i}].reward_model_path: {agent.name} is the "
                                "proposer, scored by how learnable its tasks are, not by a reward "
                                "model; give the solver one instead")


def agent_config(cfg: PPOConfig, agent: AgentConfig, index: int) -> PPOConfig:
    """The PPO config one agent's workers and driver state run under: ``actor.*`` with the
    agent's overrides, its own output folder and rollout seed."""
    out = copy.deepcopy(cfg)
    out.agents = []
    out.actor.model_path = agent.model_path
    out.actor.ref_model_path = agent.reference_path or cfg.actor.ref_model_path
    out.reward.model_path = reward_model(cfg, agent)
    out.actor.optim = _override(cfg.actor.optim, agent.optim, f"agents[{index}].optim")
    out.actor.parallel = _override(cfg.actor.parallel, agent.parallel, f"agents[{index}].parallel")
    if agent.temperature is not None:
        out.rollout.temperature = agent.temperature
    # Agents started from the same weights would otherwise draw identical samples.
    out.rollout.seed = cfg.rollout.seed + 7919 * index
    if len(cfg.agents) > 1:  # one agent's run is plain PPO's, in the run's own folder
        out.trainer.output_dir = str(agent_dir(cfg, agent.name))
    out.trainer.n_gpus_per_node, out.trainer.nnodes = agent.world_size, 1
    return out


def reward_model(cfg: PPOConfig, agent: AgentConfig) -> str | None:
    """The reward model that scores ``agent``'s samples (None: rule-based rewards only, or the
    proposer, whose score is its tasks' learnability)."""
    m = cfg.multi_agent
    if m.mode == "proposer-solver" and agent.name == (m.proposer or cfg.agents[0].name):
        return None
    return agent.reward_model_path or cfg.reward.model_path or None


def judges(cfg: PPOConfig) -> dict[str, list[str]]:
    """Reward model path -> the agents it scores, in the config's order (one judge group each).
    None for one agent, or when agents train critics (GAE): each then hosts its own reward
    model beside its critic, as one PPO run does."""
    out: dict[str, list[str]] = {}
    if len(cfg.agents) <= 1 or estimator(cfg.algorithm.adv_estimator).needs_critic:
        return out
    for agent in cfg.agents:
        path = reward_model(cfg, agent)
        if path:
            out.setdefault(path, []).append(agent.name)
    return out


def _override(section, changes: dict, where: str):
    """``section`` (a config dataclass) with the fields in ``changes`` replaced, type-checked."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(section), changes))
    except OmegaConfBaseException as err:
        raise UserError(f"config: {where}: {str(err).splitlines()[0]}") from None


def agent_dir(cfg: PPOConfig, name: str) -> Path:
    return Path(cfg.trainer.output_dir) / "agents" / name


def pools(agents: list[AgentConfig]) -> dict[str, list[AgentConfig]]:
    """Resource pool name -> its agents (``separate``: a pool per agent)."""
    out: dict[str, list[AgentConfig]] = {}
    for agent in agents:
        name = f"agent-{agent.name}" if agent.resource_pool == "separate" else agent.resource_pool
        out.setdefault(name, []).append(agent)
    return out
