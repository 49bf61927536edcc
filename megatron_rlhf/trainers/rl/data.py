"""What every worker group of a PPO run shares, loaded once by the driver: the tokenizer, the
prompts (checked against the reward functions), the run's length, the stop tokens, and the
reward functions themselves (single- and multi-agent runs alike)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rlhf.config.ppo_schema import PPOConfig
from megatron_rlhf.errors import UserError


@dataclass
class RunData:
    """What every worker group of a run shares: the tokenizer, prompts and step counts."""

    arch: object
    tokenizer: object
    train: list
    val: list
    report: object
    total: int
    steps_per_epoch: int
    stop_ids: list[int]


def setup_data(cfg: PPOConfig, rewards) -> RunData:
    """Tokenizer (the policy's), prompts (checked against ``rewards``), the run's length."""
    from transformers import AutoTokenizer

    from megatron_rlhf.data.prompts import load_prompts
    from megatron_rlhf.trainers.rl.policy import policy_files

    arch, hf_dir = policy_files(cfg.actor.model_path)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    limits = dict(tokenizer=tokenizer, prompt_key=cfg.data.prompt_key,
                  ground_truth_key=cfg.data.ground_truth_key, max_prompt=cfg.data.max_prompt_length,
                  overlong=cfg.data.overlong, need_ground_truth=rewards.needs_ground_truth(),
                  check_truth=rewards.check_ground_truth, tools=tool_schemas_for(cfg, tokenizer))
    train, report = load_prompts(cfg.data.train_files, **limits)
    val = load_prompts(cfg.data.val_files, **limits)[0] if cfg.data.val_files else []
    steps_per_epoch = len(train) // cfg.data.train_batch_size
    if steps_per_epoch == 0:
        raise UserError(f"config: {len(train)} prompts are fewer than data.train_batch_size="
                        f"{cfg.data.train_batch_size}")
    total = steps_per_epoch * cfg.trainer.total_epochs
    total = min(total, cfg.trainer.max_steps) if cfg.trainer.max_steps else total
    return RunData(arch, tokenizer, train, val, report, total, steps_per_epoch,
                   stop_ids(tokenizer, cfg.rollout.stop))


def tool_schemas_for(cfg: PPOConfig, tokenizer) -> list[dict] | None:
    """The schemas of ``rollout.tools`` the prompts are rendered with, once the chat template is
    checked to carry them (:func:`~megatron_rlhf.agent_tools.render.check_template`); None
    without tools."""
    from megatron_rlhf.agent_tools.render import check_template
    from megatron_rlhf.agent_tools.spec import check_tool_settings, tool_schemas

    tools = check_tool_settings(cfg.rollout)
    if not tools:
        return None
    check_template(tokenizer, tools, cfg.rollout.tool_call_format)
    return tool_schemas(tools)


def reward_scorer(cfg: PPOConfig):
    """``reward.fn`` and ``reward.oracle_fn`` (default ``reward.fn``) resolved; the pool that
    runs them starts later (:meth:`RewardScorer.start`)."""
    from megatron_rlhf.rewards.registry import RewardOptions
    from megatron_rlhf.rewards.scorer import RewardScorer

    r = cfg.reward
    return RewardScorer.from_specs(r.fn, r.oracle_fn or r.fn, RewardOptions(r.format_pattern),
                                   r.workers, r.timeout_s)


def stop_ids(tokenizer, stops: list[str]) -> list[int]:
    ids = []
    for text in stops:
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(tokens) != 1:
            raise UserError(f"config: rollout.stop entry {text!r} is {len(tokens)} tokens; each stop "
                            "string must be a single token")
        ids += tokens
    return ids
