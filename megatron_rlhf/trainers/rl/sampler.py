"""How an agent samples: its sampling settings and its generation, single-turn, the retry dialogue
(``rollout.max_turns``) or tool-using trajectories (``rollout.tools``), on its own ranks' engines or
the separate rollout group's. A mixin of :class:`megatron_rlhf.trainers.rl.agent.PPORun`, whose
``cfg``, ``tokenizer``, ``stop_ids``, ``rewards``, ``actor``, ``rollout_group`` and ``tools`` it
uses."""

from __future__ import annotations

from functools import cached_property

from megatron_rlhf.config.ppo_checks import reads_engine_logprobs
from megatron_rlhf.data.prompts import Prompt
from megatron_rlhf.rollout.base import Generation, SamplingParams
from megatron_rlhf.rollout.engines import stitched
from megatron_rlhf.trainers.rl.policy import policy_is_moe
from megatron_rlhf.trainers.rl.worker import PPOWorker


def reward_calls(texts: list[str], prompts: list[Prompt],
                 gens: list[Generation] | None = None) -> list[tuple]:
    """Reward-function arguments ``(response, ground_truth, prompt, extra)`` per response; a
    tool trajectory's conversation is ``extra["trajectory"]``."""
    calls = []
    for k, (text, p) in enumerate(zip(texts, prompts)):
        messages = gens[k].messages if gens is not None else None
        extra = p.extra if messages is None else {**p.extra, "trajectory": messages}
        calls.append((text, p.ground_truth, p.text, extra))
    return calls


def tool_row(prompt: Prompt) -> dict:
    """The row a user-function tool taking ``row`` receives: the prompt's text, its ground truth
    and its other columns (what a reward function gets, as one dict)."""
    return {"prompt": prompt.text, "ground_truth": prompt.ground_truth, **prompt.extra}


class AgentSampling:
    tool_metrics: dict  # the last generate()'s tools/* metrics (PPORun's field)

    def sampling(self, step: int, validation: bool = False) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(max_tokens=self.cfg.data.max_response_length,
                              temperature=r.val_temperature if validation else r.temperature,
                              top_p=1.0 if validation else r.top_p,
                              top_k=0 if validation else r.top_k, n=1 if validation else r.n,
                              stop_token_ids=self.stop_ids, seed=r.seed * 100003 + step,
                              logprobs=not validation and reads_engine_logprobs(self.cfg),
                              routed_experts=not validation and policy_is_moe(self.cfg.actor.model_path))

    def generate(self, prompts: list[Prompt], params: SamplingParams, turns: int = 1) -> list[Generation]:
        """``params.n`` samples per prompt; with ``turns > 1`` multi-turn ones (see
        :mod:`megatron_rlhf.rollout.multi_turn`); with tools, tool-using trajectories (see
        :mod:`megatron_rlhf.rollout.tool_turns`; their metrics in :attr:`tool_metrics`). The
        engines release their memory after."""
        ids = [list(p.ids) for p in prompts]
        if self.tools is not None:
            out, self.tool_metrics = self.tool_trajectories(prompts, params)
        elif turns > 1:
            from megatron_rlhf.rollout.multi_turn import run_turns

            def check(items: list[tuple[int, list[int]]]) -> list[float]:
                """One round of turns through the reward functions (errors counted)."""
                texts = [self.tokenizer.decode(tokens, skip_special_tokens=True) for _, tokens in items]
                return self.rewards.score("fn", reward_calls(texts, [prompts[i] for i, _ in items]))

            out = run_turns(self._generate_ids, ids, params, None, turns, self.feedback_ids,
                            score_many=check)
        else:
            return self._generate_ids(ids, params, release=True)  # one round trip, not two
        if self.rollout_group is None:
            self.actor.call(PPOWorker.release_rollout)
        return out

    def tool_trajectories(self, prompts: list[Prompt],
                          params: SamplingParams) -> tuple[list[Generation], dict]:
        """Tool-using trajectories of ``prompts`` on this agent's engines and their ``tools/*``
        metrics (:func:`megatron_rlhf.rollout.tool_turns.run_tool_turns`)."""
        from megatron_rlhf.rollout.tool_turns import run_tool_turns

        return run_tool_turns(self._generate_ids, [list(p.ids) for p in prompts], params, self.tools,
                              [tool_row(p) for p in prompts], [list(p.messages) for p in prompts])

    def pop_tool_metrics(self) -> dict[str, float]:
        """The ``tools/*`` metrics of the last :meth:`generate` (once; {} without tools)."""
        out, self.tool_metrics = self.tool_metrics, {}
        return out

    @cached_property
    def feedback_ids(self) -> list[int]:
        """The environment's retry turn in tokens (the same for every multi-turn sample)."""
        from megatron_rlhf.rollout.multi_turn import feedback_tokens

        return feedback_tokens(self.tokenizer, self.cfg.rollout.retry_feedback,
                               self.tokenizer.eos_token_id)

    def _generate_ids(self, ids: list[list[int]], params: SamplingParams,
                      release: bool = False) -> list[Generation]:
        if self.rollout_group is not None:
            from megatron_rlhf.trainers.rl.rollout_worker import RolloutWorker

            return stitched(self.rollout_group.call(RolloutWorker.generate, ids, params))
        return stitched(self.actor.call(PPOWorker.generate, ids, params, release))
