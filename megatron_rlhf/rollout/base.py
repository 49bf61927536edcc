"""The generator protocol every rollout backend implements.

A backend turns prompts (token ids) into sampled responses with their log-probs, accepts new
weights by Hugging Face name (from :mod:`megatron_rlhf.rollout.weight_sync`), and can give its
memory back while the trainer runs (time sharing on one device, as in a hybrid engine).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol

import torch


MEMORY_TAGS = ("weights", "kv_cache")
"""What an engine frees and re-allocates separately (SGLang's ``release_memory_occupation`` tags)."""


def memory_tags(tags: list[str] | None) -> tuple[str, ...]:
    """``tags`` checked (None: every tag), in :data:`MEMORY_TAGS` order."""
    if tags is None:
        return MEMORY_TAGS
    unknown = set(tags) - set(MEMORY_TAGS)
    if unknown:
        raise ValueError(f"engine memory tags {sorted(unknown)}: none of {MEMORY_TAGS}")
    return tuple(t for t in MEMORY_TAGS if t in tags)


@dataclass
class SamplingParams:
    max_tokens: int
    """Tokens generated at most per sample."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1 disables."""
    n: int = 1
    """Samples per prompt."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Generation of a sample ends after any of these (EOS is always one)."""
    seed: int = 0
    logprobs: bool = True
    """Record ``Generation.logprobs``; without, they are empty and the engine skips the
    full-vocabulary ``log_softmax`` of every decode step."""
    routed_experts: bool = False
    """MoE models: record ``Generation.routing``, the experts the engine chose (R3 replay)."""


@dataclass
class Generation:
    prompt_index: int
    """Index into the prompts passed to ``generate``."""
    tokens: list[int]
    """Response tokens, including the stop token that ended it (if any)."""
    logprobs: list[float]
    """``log p(token)`` under the distribution sampled from, ``softmax(logits / temperature)``
    (untempered when greedy), before any top-k/top-p cut: what the trainer computes."""
    finished: bool
    """True if a stop token ended it, False if it hit ``max_tokens``."""
    mask: list[int] | None = None
    """Multi-turn samples: 1 on the policy's tokens, 0 on the environment's between turns
    (``None``: every token is the policy's)."""
    turn_ends: list[int] | None = None
    """Multi-turn samples: index in ``tokens`` of each turn's last policy token."""
    turn_scores: list[float] | None = None
    """Multi-turn samples: the rule-based reward of each turn."""
    messages: list[dict] | None = None
    """Tool trajectories: the conversation after the prompt (the assistant turns' texts and the
    tool messages), which a reward function reads as ``extra["trajectory"]``."""
    routing: torch.Tensor | None = None
    """``SamplingParams.routed_experts``: the top-k expert ids the engine's routers chose for
    every token it read, ``[prompt + response - 1, moe_layers, topk]`` int16 (the last response
    token is never read back in), MoE layers in model order."""


class Generator(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """``params.n`` generations per prompt, prompt-major (prompt 0's samples first)."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full (unsharded) HF-named tensors into the engine; called bucket by bucket."""

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Free what ``tags`` name (:data:`MEMORY_TAGS`; None: all); ``resume_memory`` + a full
        weight sync bring the weights back."""

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Re-allocate what ``tags`` name (None: all). SGLang's order in a colocated step:
        ``weights``, the weight sync, the trainer steps aside, ``kv_cache``, generation."""
