"""The ``hf`` rollout backend: transformers' ``generate`` (KV cache, batched, left-padded) on the
policy's Hugging Face architecture, fed by the trainer's weight sync.

It runs on CPU (the demo, the tests) and on GPU; SGLang (:mod:`.sglang_engine`) is the fast GPU
backend behind the same protocol.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch

from megatron_rlhf.distributed.platform import bridge_suspended
from megatron_rlhf.rollout.base import Generation, SamplingParams


# A checkpoint's per-expert weight (transformers 5 saves experts one by one, fuses them in memory).
_EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


class HFGenerator:
    """One generator replica. With ``tp_size > 1`` the replica spans the ranks of the calling
    torch.distributed world (transformers' tensor parallelism over DTensor; gloo on CPU), and
    every rank of it must make the same calls with the same prompts."""

    def __init__(self, hf_dir: str, dtype: torch.dtype, pad_id: int, eos_id: int,
                 device: str = "cpu", max_batch: int = 256, tp_size: int = 1):
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
        if tp_size == 1:
            with torch.device(device):
                self.model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        else:
            self.model = _tensor_parallel_model(config, dtype, tp_size)
        self.pad_id, self.eos_id, self.device, self.max_batch = pad_id, eos_id, device, max_batch
        self._params = dict(self.model.named_parameters())
        self._shapes = {n: _local(p).shape for n, p in self._params.items()}
        state = self.model.state_dict()
        # Weights that are buffers (DeepSeek-V3's e_score_correction_bias): small, kept resident.
        self._buffers = {n: b for n, b in self.model.named_buffers() if n in state}
        self._tied = {n for n in state if n not in self._params and n not in self._buffers}

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take each tensor's values. A contiguous tensor of the right dtype and device is adopted
        as the parameter's storage instead of copied: the weight sync hands over storage it never
        writes again (fresh gathers, or the trainer's own parameters when no resharding is
        needed, which the next sync would deliver anyway), so the engine's copy pass is saved."""
        with torch.no_grad():
            for name, tensor in named_tensors:
                param = self._params.get(name)
                if param is None and name in self._buffers:
                    _local(self._buffers[name]).copy_(_local_shard(self._buffers[name], tensor))
                    continue
                if param is None and self._load_expert(name, tensor):
                    continue
                if param is None:
                    if name in self._tied:
                        continue  # a tied alias of a parameter loaded under its own name
                    raise KeyError(f"rollout engine has no parameter {name!r}")
                if param.shape != tensor.shape:
                    raise ValueError(f"weight sync: {name} has shape {tuple(tensor.shape)}, the "
                                     f"engine expects {tuple(param.shape)}")
                if (not _is_dtensor(param) and tensor.is_contiguous() and tensor.dtype == param.dtype
                        and tensor.device == param.device):
                    param.data = tensor.detach()
                else:
                    _local(param).copy_(_local_shard(param, tensor))

    def _load_expert(self, name: str, tensor: torch.Tensor) -> bool:
        """A checkpoint's per-expert tensor into transformers' fused expert parameters
        (``experts.gate_up_proj [E, 2I, H]`` holds gate then up; ``experts.down_proj [E, H, I]``);
        False when ``name`` is no such tensor."""
        match = _EXPERT.fullmatch(name)
        if match is None:
            return False
        prefix, expert, kind = match.group(1), int(match.group(2)), match.group(3)
        fused = self._params.get(f"{prefix}.{'down_proj' if kind == 'down' else 'gate_up_proj'}")
        if fused is None or _is_dtensor(fused):
            return False
        target = fused[expert]
        if kind != "down":
            half = target.shape[0] // 2
            target = target[:half] if kind == "gate" else target[half:]
        if target.shape != tensor.shape:
            raise ValueError(f"weight sync: {name} has shape {tuple(tensor.shape)}, the engine "
                             f"expects {tuple(target.shape)}")
        target.copy_(tensor)
        return True

    def release_memory(self) -> None:
        """Drop the weight storage (this rank's shard of each DTensor with ``tp_size > 1``)."""
        for param in self._params.values():
            _storage_holder(param).data = torch.empty(0, dtype=param.dtype, device=param.device)
        self._released = True

    def resume_memory(self) -> None:
        """Allocate (uninitialised) weight storage again; the next weight sync fills it."""
        for name, param in self._params.items():
            holder = _storage_holder(param)
            if holder.numel() == 0 and self._shapes[name].numel():
                holder.data = torch.empty(self._shapes[name], dtype=param.dtype, device=param.device)

    def resident_bytes(self) -> int:
        """Bytes of weight storage this rank holds now."""
        return sum(_local(p).numel() * p.element_size() for p in self._params.values())

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        rows = [i for i in range(len(prompts)) for _ in range(params.n)]
        out: list[Generation] = []
        torch.manual_seed(params.seed)  # one seed per call: resumed runs sample the same tokens
        # transformers makes no CUDA request of its own: the CPU bridge's per-op cost (about a
        # third of a tiny model's decode time) buys nothing here.
        with bridge_suspended():
            for start in range(0, len(rows), self.max_batch):
                out += self._generate_chunk(prompts, rows[start:start + self.max_batch], params)
        return out

    def _generate_chunk(self, prompts, rows, params: SamplingParams) -> list[Generation]:
        width = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(rows):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        stops = [self.eos_id, *[s for s in params.stop_token_ids if s != self.eos_id]]
        sample = params.temperature > 0
        kwargs = dict(do_sample=sample, max_new_tokens=params.max_tokens, eos_token_id=stops,
                      pad_token_id=self.pad_id, return_dict_in_generate=True)
        if sample:
            kwargs.update(temperature=params.temperature, top_p=params.top_p,
                          top_k=params.top_k if params.top_k > 0 else None)  # 0, -1: off
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        # The distribution sampled from, as the trainer scores it (top-k/p cut aside).
        recorder = _ChosenLogprobs(params.temperature if sample else 1.0)
        hooks = [self.model.register_forward_pre_hook(recorder.before_step, with_kwargs=True),
                 self.model.register_forward_hook(recorder.after_step)]
        try:
            result = self.model.generate(input_ids=ids.to(self.device),
                                         attention_mask=mask.to(self.device), **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
        new = result.sequences[:, width:]
        chosen = recorder.finish(new[:, -1]).cpu()
        new = new.cpu()
        out = []
        for r, i in enumerate(rows):
            tokens, finished = new[r].tolist(), False
            for k, token in enumerate(tokens):
                if token in stops:
                    tokens, finished = tokens[:k + 1], True
                    break
            out.append(Generation(i, tokens, chosen[r, :len(tokens)].tolist(), finished))
        return out


class _ChosenLogprobs:
    """Log-probs ``[rows, steps]`` of the sampled tokens, via forward hooks on the model.

    Each forward's last-position distribution waits until the next forward, whose input is the
    token sampled from it. Keeping every step's logits instead (``output_logits``) would hold
    rows x steps x vocab floats: ~150 GiB for 256 rows of 1024 tokens over a 152k vocabulary.
    """

    def __init__(self, temperature: float):
        self.temperature, self.pending, self.columns = temperature, None, []

    def _take(self, tokens: torch.Tensor) -> None:
        self.columns.append(self.pending.gather(-1, tokens.reshape(-1, 1)))
        self.pending = None

    def before_step(self, _module, args, kwargs) -> None:
        if self.pending is not None:
            ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            self._take(ids[:, -1])

    def after_step(self, _module, _args, output) -> None:
        logits = output.logits[:, -1].float()
        self.pending = torch.log_softmax(logits / self.temperature, dim=-1)

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        self._take(last_tokens)
        return torch.cat(self.columns, dim=1)


def _is_dtensor(tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _local(param):
    return param.to_local() if _is_dtensor(param) else param


def _storage_holder(param) -> torch.Tensor:
    """The plain tensor whose ``.data`` is the weight storage: the parameter itself, or a
    DTensor's local shard (DTensor has no public way to swap that storage)."""
    return param._local_tensor if _is_dtensor(param) else param


def _local_shard(param, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``full`` for a DTensor parameter (Shard(d) cuts like ``chunk``)."""
    if not _is_dtensor(param):
        return full
    from torch.distributed.tensor import Shard

    piece = full
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            size = param.device_mesh.size(mesh_dim)
            coordinate = param.device_mesh.get_coordinate()[mesh_dim]
            piece = piece.chunk(size, dim=placement.dim)[coordinate]
    return piece


def _tensor_parallel_model(config, dtype: torch.dtype, tp_size: int):
    """transformers' TP plan over the running world: it loads through ``from_pretrained``, so a
    randomly initialised copy is written once to a scratch folder (the weight sync that always
    follows replaces every value)."""
    import tempfile

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    if dist.get_world_size() != tp_size:
        raise ValueError(f"the hf rollout backend supports rollout.tp = 1 or the worker group's "
                         f"world size ({dist.get_world_size()}), not {tp_size}")
    box = [tempfile.mkdtemp(prefix="mrlhf_tp_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if dist.get_rank() == 0:
        AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(box[0])
    dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(
        box[0], dtype=dtype, distributed_config=DistributedConfig(tp_size=tp_size)).eval()
    dist.barrier()
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(box[0], ignore_errors=True)
    return model
