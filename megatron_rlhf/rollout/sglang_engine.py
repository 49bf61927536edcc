"""The ``sglang`` rollout backend (GPU only; ``pip install -e .[gpu]``).

The first rank of each generator replica starts an in-process ``sglang.Engine`` with
``tp_size=rollout.tp`` (SGLang shards the full HF tensors it is given itself); the other ranks of
the replica only take part in the weight sync. Weights arrive through
``update_weights_from_tensor`` bucket by bucket; ``release_memory_occupation`` frees the KV cache
and weights while the trainer runs. Engine arguments and per-sample sampling parameters come
from :mod:`megatron_rlhf.config.sglang` (checked against SGLang's names at start-up). Not
runnable on CPU: SGLang needs CUDA.
"""

from __future__ import annotations

from typing import Iterable

import torch

from megatron_rlhf.config.ppo_schema import RolloutConfig
from megatron_rlhf.config.sglang import engine_args, sampling_args
from megatron_rlhf.rollout.base import Generation, SamplingParams


class SGLangGenerator:
    def __init__(self, hf_dir: str, cfg: RolloutConfig, dtype: torch.dtype, eos_id: int):
        import torch.distributed as dist

        self.cfg, self.engine, self._released, self.eos_ids = cfg, None, False, {eos_id}
        if dist.get_rank() % cfg.tp == 0:
            import sglang

            self.engine = sglang.Engine(**engine_args(
                cfg, hf_dir, str(dtype).removeprefix("torch."), torch.cuda.current_device()))

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.engine is not None:
            result = self.engine.update_weights_from_tensor(named_tensors=list(named_tensors))
            if isinstance(result, tuple) and not result[0]:  # (success, message)
                raise RuntimeError(f"sglang rejected the weight update: {result[1]}")

    def release_memory(self) -> None:
        if self.engine is not None and not self._released:
            self.engine.release_memory_occupation()
            self._released = True

    def resume_memory(self) -> None:
        # SGLang fails to resume what it never released (the first sync after start-up).
        if self.engine is not None and self._released:
            self.engine.resume_memory_occupation()
            self._released = False

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if self.engine is None or not prompts:  # SGLang rejects an empty batch
            return []
        rows = [i for i in range(len(prompts)) for _ in range(params.n)]
        stops = {*params.stop_token_ids, *self.eos_ids}
        outputs = self.engine.generate(input_ids=[prompts[i] for i in rows],
                                       sampling_params=sampling_args(params, len(rows)),
                                       return_logprob=True)
        result = []
        for row, out in zip(rows, outputs):
            meta = out["meta_info"]
            tokens = [token for _, token, _ in meta["output_token_logprobs"]]
            logprobs = [lp for lp, _, _ in meta["output_token_logprobs"]]
            # SGLang reports "length" when the last allowed token is also a stop token.
            finished = ((meta.get("finish_reason") or {}).get("type") == "stop"
                        or bool(tokens) and tokens[-1] in stops)
            result.append(Generation(row, tokens, logprobs, finished))
        return result
