"""The ``hf`` rollout backend: transformers' ``generate`` (KV cache, batched, left-padded) on the
policy's Hugging Face architecture, fed by the trainer's weight sync.

It runs on CPU (the demo, the tests) and on GPU; SGLang (:mod:`.sglang_engine`) is the fast GPU
backend behind the same protocol.
"""

from __future__ import annotations

import re
from functools import cached_property
from typing import Iterable

import torch

from megatron_rlhf.distributed.platform import bridge_suspended
from megatron_rlhf.rollout.base import MEMORY_TAGS, Generation, SamplingParams, memory_tags


# A checkpoint's per-expert weight (transformers 5 saves experts one by one, fuses them in memory).
_EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


class HFGenerator:
    """One rank's part of a generator engine. With an engine ``slot`` of several ranks (engines
    laid over the world by :mod:`~megatron_rlhf.distributed.engine_placement`), the engine is
    transformers' tensor parallelism over DTensor across those ranks (gloo on CPU), experts
    split over them too with ``expert_parallel``; every rank of an engine must make the same
    calls with the same prompts."""

    def __init__(self, hf_dir: str, dtype: torch.dtype, pad_id: int, eos_id: int,
                 device: str = "cpu", max_batch: int = 256, slot=None,
                 expert_parallel: bool = False, adopt_storage: bool = True):
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
        with torch.device(device):
            self.model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        if slot is not None and slot.tp > 1:
            self.model = _tensor_parallel(self.model, slot, expert_parallel, device)
        self.pad_id, self.eos_id, self.device, self.max_batch = pad_id, eos_id, device, max_batch
        self.adopt_storage = adopt_storage
        self.share_prefill = True  # a prompt sampled n times is prefilled once (_prefill)
        self._params = dict(self.model.named_parameters())
        self._shapes = {n: _local(p).shape for n, p in self._params.items()}
        state = self.model.state_dict()
        # Weights that are buffers (DeepSeek-V3's e_score_correction_bias): small, kept resident.
        self._buffers = {n: b for n, b in self.model.named_buffers() if n in state}
        self._tied = {n for n in state if n not in self._params and n not in self._buffers}
        # Sharded fused expert tensors being assembled from per-expert ones: name -> (full, seen)
        self._assembling: dict[str, list] = {}
        self.resident = set(MEMORY_TAGS)  # what release_memory / resume_memory last left

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take each tensor's values. A contiguous tensor of the right dtype and device is adopted
        as the parameter's storage instead of copied: the weight sync hands over storage it never
        writes again (fresh gathers, or the trainer's own parameters when no resharding is
        needed, which the next sync would deliver anyway), so the engine's copy pass is saved;
        not with ``adopt_storage=False`` (the trainer offloads its parameters after the sync)."""
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
                if (self.adopt_storage and not _is_dtensor(param) and tensor.is_contiguous()
                        and tensor.dtype == param.dtype and tensor.device == param.device):
                    param.data = tensor.detach()
                else:
                    _local(param).copy_(_local_shard(param, tensor))

    def _load_expert(self, name: str, tensor: torch.Tensor) -> bool:
        """A checkpoint's per-expert tensor into transformers' fused expert parameters
        (``experts.gate_up_proj [E, 2I, H]`` holds gate then up; ``experts.down_proj [E, H, I]``);
        False when ``name`` is no such tensor. A sharded fused parameter is assembled whole
        (one layer's experts at most), then this rank keeps its shard."""
        match = _EXPERT.fullmatch(name)
        if match is None:
            return False
        prefix, expert, kind = match.group(1), int(match.group(2)), match.group(3)
        fused_name = f"{prefix}.{'down_proj' if kind == 'down' else 'gate_up_proj'}"
        fused = self._params.get(fused_name)
        if fused is None:
            return False
        sharded = _is_dtensor(fused)
        if sharded:
            entry = self._assembling.setdefault(
                fused_name, [torch.empty(fused.shape, dtype=fused.dtype, device=tensor.device), 0])
            target = entry[0][expert]
        else:
            target = fused[expert]
        if kind != "down":
            half = target.shape[0] // 2
            target = target[:half] if kind == "gate" else target[half:]
        if target.shape != tensor.shape:
            raise ValueError(f"weight sync: {name} has shape {tuple(tensor.shape)}, the engine "
                             f"expects {tuple(target.shape)}")
        target.copy_(tensor)
        if sharded:
            entry[1] += 1
            if entry[1] == fused.shape[0] * (1 if kind == "down" else 2):
                _local(fused).copy_(_local_shard(fused, entry[0]))
                del self._assembling[fused_name]
        return True

    def release_memory(self, tags: list[str] | None = None) -> None:
        """``weights``: drop the weight storage (this rank's shard of each DTensor in an engine
        of several ranks). ``kv_cache``: transformers allocates it per :meth:`generate` call and
        frees it after, so this tag is a state that :meth:`generate` checks."""
        tags = memory_tags(tags)
        if "weights" in tags:
            for param in self._params.values():
                _storage_holder(param).data = torch.empty(0, dtype=param.dtype, device=param.device)
        self.resident -= set(tags)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """``weights``: allocate (uninitialised) weight storage again, the next weight sync
        fills it; ``kv_cache``: allow :meth:`generate` again."""
        tags = memory_tags(tags)
        if "weights" in tags:
            for name, param in self._params.items():
                holder = _storage_holder(param)
                if holder.numel() == 0 and self._shapes[name].numel():
                    holder.data = torch.empty(self._shapes[name], dtype=param.dtype, device=param.device)
        self.resident |= set(tags)

    def resident_bytes(self) -> int:
        """Bytes of weight storage this rank holds now."""
        return sum(_local(p).numel() * p.element_size() for p in self._params.values())

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if self.resident != set(MEMORY_TAGS):
            raise RuntimeError(f"hf engine: generate() needs weights and kv_cache resumed; "
                               f"{sorted(set(MEMORY_TAGS) - self.resident)} released (call "
                               "resume_memory first)")
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
                 self.model.register_forward_hook(recorder.after_step)] if params.logprobs else []
        routes = _RoutedExperts(self.model, len(rows)) if params.routed_experts else None
        hooks += routes.hooks if routes is not None else []
        try:
            cache = self._prefill(ids, mask, rows, routes)
            if cache is not None:
                kwargs["past_key_values"] = cache
                recorder.pending = None  # the prefill predicts no sampled token
            result = self.model.generate(input_ids=ids.to(self.device),
                                         attention_mask=mask.to(self.device), **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
        new = result.sequences[:, width:]
        chosen = recorder.finish(new[:, -1]).cpu() if params.logprobs else None
        new = new.cpu()
        out = []
        for r, i in enumerate(rows):
            tokens, finished = new[r].tolist(), False
            for k, token in enumerate(tokens):
                if token in stops:
                    tokens, finished = tokens[:k + 1], True
                    break
            logprobs = chosen[r, :len(tokens)].tolist() if chosen is not None else []
            out.append(Generation(i, tokens, logprobs, finished))
            if routes is not None:  # the prompt's real tokens (left padding cut) and the response's
                out[-1].routing = routes.row(r, width - len(prompts[i]), width + len(tokens) - 1)
        return out


    @torch.no_grad()
    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor, rows: list[int], routes):
        """The KV cache of each distinct prompt's tokens but its last, computed once and
        repeated for every row that samples it (``rows``: the prompt of each row), for
        ``generate`` to continue from; None when no prompt repeats. ``routes`` records the
        prefill's routing per distinct prompt, then repeats it as the cache."""
        distinct = sorted(set(rows), key=rows.index)
        if not self.share_prefill or len(distinct) == len(rows) or ids.shape[1] < 2:
            return None
        from transformers import DynamicCache

        first = torch.tensor([rows.index(i) for i in distinct])
        which = torch.tensor([distinct.index(i) for i in rows])
        cache = DynamicCache(config=self.model.config)
        if routes is not None:
            routes.rows = len(distinct)
        prefix = mask[first, :-1]
        # Positions as generate() derives them from the mask (left padding: the first real token
        # at 0), so that the continuation's are consistent with the cache's.
        positions = (prefix.cumsum(-1) - 1).clamp(min=0)
        self.model(input_ids=ids[first, :-1].to(self.device), attention_mask=prefix.to(self.device),
                   position_ids=positions.to(self.device), past_key_values=cache, use_cache=True,
                   logits_to_keep=1)
        cache.batch_select_indices(which.to(self.device))
        if routes is not None:
            routes.repeat(which)
        return cache


class _RoutedExperts:
    """Top-k expert ids of every MoE router, via forward hooks: transformers' routers
    (Qwen2/3-MoE ``*TopKRouter``, DeepSeek-V3 ``DeepseekV3TopkRouter``) return their ids last,
    ``[rows * positions, K]`` row-major."""

    def __init__(self, model, rows: int):
        routers = [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]
        if not routers:
            raise ValueError(f"routed experts asked of {type(model).__name__}, which has no MoE router")
        self.rows, self.steps = rows, [[] for _ in routers]
        self.hooks = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    def _hook(self, index: int):
        def record(_module, _args, output):
            ids = output[-1]
            ids = ids.full_tensor() if _is_dtensor(ids) else ids
            self.steps[index].append(ids.detach().to("cpu", torch.int16).view(self.rows, -1, ids.shape[-1]))
        return record

    def repeat(self, which: torch.Tensor) -> None:
        """What was recorded for distinct prompts (a shared prefill), for every row: row ``r``
        gets the record of prompt ``which[r]``."""
        self.steps = [[step[which] for step in steps] for steps in self.steps]
        self.rows = len(which)

    @cached_property
    def stacked(self) -> torch.Tensor:
        """``[rows, positions, layers, K]`` once generation is over."""
        return torch.stack([torch.cat(steps, dim=1) for steps in self.steps], dim=2)

    def row(self, row: int, start: int, end: int) -> torch.Tensor:
        """Positions ``start:end`` of ``row``: ``[end - start, layers, K]``."""
        return self.stacked[row, start:end].clone()


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
    """This rank's piece of ``full`` for a DTensor parameter, cut as its placements cut it
    (strided shards of packed gate/up included); no communication: every rank holds ``full``."""
    if not _is_dtensor(param):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(param.device), param.device_mesh, param.placements,
                             src_data_rank=None).to_local()


def _tensor_parallel(model, slot, expert_parallel: bool, device: str):
    """``model`` split over the ranks of its engine with transformers' TP plan (and its EP plan
    with ``expert_parallel``). The meshes cover every engine of the world, one row each (a mesh
    is made by all ranks together); each rank keeps its engine's row."""
    from torch.distributed.device_mesh import DeviceMesh
    from transformers.distributed import DistributedConfig
    from transformers.distributed.utils import TransformersDeviceMesh

    from megatron_rlhf.distributed.engine_placement import engine_grid

    grid = engine_grid(slot)
    if len({len(r) for r in grid}) != 1:
        raise ValueError(f"hf rollout engines of different sizes: {grid}")
    shape = (len(grid), 1, 1, 1, slot.tp)
    kind = torch.device(device).type
    mesh = lambda names: DeviceMesh(kind, torch.tensor(grid).view(shape),  # noqa: E731
                                    mesh_dim_names=("engine", *names))
    dense, experts = mesh(("pp", "dp_replicate", "fsdp", "tp")), mesh(("pp", "dp_replicate", "efsdp", "ep"))
    config = DistributedConfig(tp_size=slot.tp, ep_size=slot.tp if expert_parallel else None)
    meshes = TransformersDeviceMesh(dense["pp", "dp_replicate", "fsdp", "tp"],
                                    experts["pp", "dp_replicate", "efsdp", "ep"])
    return type(model).maybe_distribute_model(model, config, meshes).eval()
