"""The ``sglang`` rollout backend (GPU only; ``pip install -e .[gpu]``).

An engine of ``rollout.tp`` GPUs runs one ``sglang.Engine`` process a node
(:mod:`~megatron_rlhf.distributed.engine_placement`): the worker rank on the lowest of the
engine's GPUs there starts it with ``tp_size=rollout.tp`` from that GPU on (its worker group sees
the node's GPUs); an engine over several nodes meets at its first process's address
(``nnodes``, ``node_rank``, ``dist_init_addr``). That first process takes the requests.

Weights: every worker rank on the engine's GPUs holds each bucket's full HF tensors on its own
GPU after the resharding sync; it hands SGLang's TP rank on that GPU a CUDA-IPC handle to them
(``MultiprocessingSerializer``), the engine's first rank gathers one handle per TP rank, in SGLang's
TP-rank order, and submits them as one ``update_weights_from_tensor``: no tensor crosses GPUs.
``release_memory_occupation(tags=...)`` frees the KV cache and weights while the trainer runs,
``resume_memory_occupation(tags=...)`` brings them back tag by tag (``weights`` before the
weight sync, ``kv_cache`` after the trainer has offloaded its state). Engine
arguments and per-sample sampling parameters come from :mod:`megatron_rlhf.config.sglang`.
Not runnable on CPU: SGLang needs CUDA.
"""

from __future__ import annotations

import os
from typing import Iterable

import torch
import torch.distributed as dist

from megatron_rlhf.config.ppo_schema import RolloutConfig
from megatron_rlhf.config.sglang import engine_args, sampling_args
from megatron_rlhf.distributed.engine_placement import EngineSlot, engine_groups, engine_addresses
from megatron_rlhf.rollout.base import Generation, SamplingParams, memory_tags


class SGLangGenerator:
    def __init__(self, hf_dir: str, cfg: RolloutConfig, dtype: torch.dtype, eos_id: int,
                 slot: EngineSlot):
        self.cfg, self.slot, self.engine, self.eos_ids = cfg, slot, None, {eos_id}
        self.released: set[str] = set()  # tags SGLang holds released
        self.is_head = dist.get_rank() == slot.head
        # Collective: every rank makes every engine's group (none for one-GPU engines).
        self.group = engine_groups(slot) if slot.tp > 1 else None
        address = engine_addresses(slot)  # collective
        proc = slot.process
        self.moe_shape = _moe_shape(hf_dir)
        if proc is not None:
            import sglang

            if proc.node_rank > 0:  # SGLang's Python API must not block in a follower node
                os.environ["SGLANG_BLOCK_NONZERO_RANK_CHILDREN"] = "0"
            self.engine = sglang.Engine(**engine_args(
                cfg, hf_dir, str(dtype).removeprefix("torch."), local_gpu(min(proc.gpus)),
                proc.nnodes, proc.node_rank, address, moe=self.moe_shape[1] > 0))

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        payload = MultiprocessingSerializer.serialize(list(named_tensors))
        payloads = (gather_in_member_order(payload, self.slot, self.group)
                    if self.group is not None else [payload])
        if self.is_head:
            request = UpdateWeightsFromTensorReqInput(serialized_named_tensors=payloads,
                                                      flush_cache=True)
            result = self.engine.loop.run_until_complete(
                self.engine.tokenizer_manager.update_weights_from_tensor(request, None))
            if isinstance(result, tuple) and not result[0]:  # (success, message)
                raise RuntimeError(f"sglang rejected the weight update: {result[1]}")
        if self.group is not None:  # the tensors behind the handles outlive every TP rank's read
            dist.barrier(group=self.group)

    def release_memory(self, tags: list[str] | None = None) -> None:
        """SGLang's ``release_memory_occupation`` of the ``tags`` (None: weights and KV cache)
        not released yet; always by name, so tags of SGLang's we do not resume stay put."""
        todo = [t for t in memory_tags(tags) if t not in self.released]
        if self.is_head and todo:
            self.engine.release_memory_occupation(tags=todo)
        self.released.update(todo)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        # SGLang fails to resume what it never released (the first sync after start-up).
        todo = [t for t in memory_tags(tags) if t in self.released]
        if self.is_head and todo:
            self.engine.resume_memory_occupation(tags=todo)
        self.released.difference_update(todo)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if self.released:
            raise RuntimeError(f"sglang engine: generate() with {sorted(self.released)} released "
                               "(call resume_memory first)")
        if not self.is_head or not prompts:  # SGLang rejects an empty batch
            return []
        rows = [i for i in range(len(prompts)) for _ in range(params.n)]
        stops = {*params.stop_token_ids, *self.eos_ids}
        extra = {"return_routed_experts": True} if params.routed_experts else {}
        outputs = self.engine.generate(input_ids=[prompts[i] for i in rows],
                                       sampling_params=sampling_args(params, len(rows)),
                                       return_logprob=True, **extra)
        result = []
        for row, out in zip(rows, outputs):
            meta = out["meta_info"]
            tokens = [token for _, token, _ in meta["output_token_logprobs"]]
            logprobs = [lp for lp, _, _ in meta["output_token_logprobs"]]
            # SGLang reports "length" when the last allowed token is also a stop token.
            finished = ((meta.get("finish_reason") or {}).get("type") == "stop"
                        or bool(tokens) and tokens[-1] in stops)
            result.append(Generation(row, tokens, logprobs, finished))
            if params.routed_experts:
                result[-1].routing = routed_experts(meta, len(prompts[row]) + len(tokens) - 1,
                                                    self.moe_shape)
        return result


def _moe_shape(hf_dir: str) -> tuple[int, int]:
    """(MoE layers, experts per token) of the model; (0, 0) for a dense one."""
    from megatron_rlhf.convert.checkpoints import read_hf_arch

    moe = read_hf_arch(hf_dir).moe
    return (sum(moe.layer_pattern), moe.topk) if moe is not None else (0, 0)


def routed_experts(meta: dict, positions: int, shape: tuple[int, int]) -> torch.Tensor:
    """SGLang's ``meta_info["routed_experts"]`` (base64 of int32 ``[tokens, layers, topk]`` over
    the tokens the engine ran) as the first ``positions`` tokens' ``[positions, layers, topk]``
    int16."""
    import base64

    import numpy as np

    if meta.get("routed_experts") is None:
        raise RuntimeError("sglang returned no routed experts: the engine needs "
                           "enable_return_routed_experts (set for MoE models)")
    flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
    per_token = shape[0] * shape[1]
    if flat.size % per_token or flat.size // per_token < positions:
        raise RuntimeError(f"sglang returned {flat.size} routed expert ids; {positions} tokens of "
                           f"{shape[0]} MoE layers x top-{shape[1]} need {positions * per_token}")
    return torch.from_numpy(flat.copy()).view(-1, *shape)[:positions].to(torch.int16)


def local_gpu(gpu: int) -> int:
    """A node's GPU id as a CUDA device index of this process: Ray's ids are the node's (Slurm
    may have given the node GPUs 4-7); torchrun's and Slurm's local ranks already are indices."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if "MRLHF_NODE" in os.environ and visible:
        return visible.split(",").index(str(gpu))
    return gpu


def gather_in_member_order(obj, slot: EngineSlot, group) -> list | None:
    """``obj`` of every rank of the engine, on its head, in ``slot.members`` order (SGLang's TP
    ranks: node by node, GPU by GPU); None elsewhere."""
    ranks = dist.get_process_group_ranks(group)
    found = [None] * len(ranks) if dist.get_rank() == slot.head else None
    dist.gather_object(obj, found, dst=slot.head, group=group)
    if found is None:
        return None
    by_rank = dict(zip(ranks, found))
    return [by_rank[r] for r in slot.members]
