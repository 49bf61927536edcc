"""megatron_rlhf: RLHF (reward modelling, PPO and relatives) on Megatron-Core."""

__version__ = "0.1.0"
