"""What megatron allocates for a trained model after one optimizer step, per rank, next to what
the planner says: weights, gradient buffers and optimizer state (distributed optimizer on and
off, fp32 and bf16, dense, expert and tied-embedding buffers), and the bytes autograd saves for
backward in the decoder (no, selective and full recompute). Run by tests/test_planner_memory.py.
Usage: torchrun --nproc-per-node 2 tests/dist_memory.py MODELS_ROOT FAMILIES_ROOT OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rlhf.config.schema import OptimConfig  # noqa: E402
from megatron_rlhf.data.packing import pack_token_grid  # noqa: E402
from megatron_rlhf.models.forward import _rotary_modules  # noqa: E402
from megatron_rlhf.convert.checkpoints import read_hf_arch  # noqa: E402
from megatron_rlhf.distributed.launch import init_distributed  # noqa: E402
from megatron_rlhf.models.builder import build_model  # noqa: E402
from megatron_rlhf.models.hf_config import padded_vocab_size  # noqa: E402
from megatron_rlhf.models.megatron_config import ModelOptions  # noqa: E402
from megatron_rlhf.planning.activations import Workload, decoder_saved_bytes  # noqa: E402
from megatron_rlhf.planning.memory import train_state_bytes  # noqa: E402
from megatron_rlhf.models.lora import LoRASpec, apply_lora  # noqa: E402
from megatron_rlhf.planning.params import rank_tensors, with_lora  # noqa: E402
from megatron_rlhf.trainers.engine import make_trainable, train_step  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_parity import layout_groups  # noqa: E402
from dist_shared_prompts import CAPACITY, make_batch  # noqa: E402

# name -> (model, (tp, pp, dp, ep), dtype, distributed optimizer)
STATE_CASES = {
    f"{model}/{label}/{dtype}/{'dist' if dist_opt else 'plain'}": (model, layout, dtype, dist_opt)
    for model, label, layout, dtypes in (
        ("qwen2_policy", "dp2", (1, 1, None, 1), ("float32", "bfloat16")),
        ("qwen3_moe", "ep2_dp2", (1, 1, None, 2), ("float32",)),
        ("llama_policy", "pp2_tied", (1, 2, None, 1), ("float32",)),
    )
    for dtype in dtypes for dist_opt in (False, True)
}
# LoRA: the base frozen, adapters (and a value head) in DDP's buffers and the optimizer.
LORA_ALL_DENSE = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
LORA_MLA = ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj",
            "linear_proj", "linear_fc1", "linear_fc2")
LORA_CASES = {
    f"lora/{model}/{label}/{dtype}/{'dist' if dist_opt else 'plain'}": (model, layout, dtype, dist_opt, targets)
    for model, label, layout, dtypes, targets in (
        ("qwen2_policy", "dp2", (1, 1, None, 1), ("float32", "bfloat16"), LORA_ALL_DENSE),
        ("qwen2_rm", "tp2", (2, 1, None, 1), ("float32",), LORA_ALL_DENSE),
        ("qwen3_moe", "ep2_dp2", (1, 1, None, 2), ("float32",), LORA_ALL_DENSE),
        ("deepseek_v3", "pp2", (1, 2, None, 1), ("bfloat16",), LORA_MLA),
    )
    for dtype in dtypes for dist_opt in (False, True)
}
ACTIVATION_MODELS = ("qwen2_policy", "qwen3_moe", "deepseek_v3")
RECOMPUTE = {"none": ModelOptions(),
             "selective": ModelOptions(recompute_granularity="selective",
                                       recompute_modules=("core_attn",)),
             "full": ModelOptions(recompute_granularity="full", recompute_method="uniform",
                                  recompute_num_layers=1)}


def _storages(tensors) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def measured_state(trainable) -> dict[str, int]:
    model = trainable.model
    params = _storages(p.data for p in model.parameters())
    buffers = [*model.buffers, *model.expert_parallel_buffers]
    grads = _storages(b.grad_data for b in buffers)
    optimizers = getattr(trainable.optimizer, "chained_optimizers", [trainable.optimizer])
    state = {}
    for optimizer in optimizers:
        torch_optimizer = optimizer.optimizer
        for group in torch_optimizer.param_groups:
            for main in group["params"]:
                state.update(_storages([main]))  # fp32 copies of bf16 weights; else the weights
                state.update(_storages(v for k, v in torch_optimizer.state[main].items()
                                       if k != "step" and torch.is_tensor(v)))
    optimizer_only = {k: v for k, v in state.items() if k not in params and k not in grads}
    return {"weights": sum(params.values()), "gradients": sum(grads.values()),
            "optimizer": sum(optimizer_only.values())}


def _loss(output, batch):
    return output.float().square().mean(), {}


def state_case(path: Path, layout: tuple, dtype: str, distributed: bool,
               lora: tuple[str, ...] | None = None) -> dict:
    arch = read_hf_arch(path)
    tp, pp, dp, ep = layout
    groups = layout_groups((tp, pp, dp, ep), arch.shape)
    torch_dtype = getattr(torch, dtype)
    padded = padded_vocab_size(arch.vocab_size, tp)
    model = build_model(arch, groups, torch_dtype, padded)
    if lora:
        apply_lora(model, LoRASpec(rank=4, target_modules=lora))
    trainable = make_trainable(model, groups, OptimConfig(lr=1e-4), 10, distributed)
    tokens = torch.randint(0, arch.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    train_step(trainable, [{"input_ids": tokens}], _loss)
    layout = groups.layout
    tensors = rank_tensors(arch, layout, groups.pp_rank, padded_vocab=padded)
    if lora:
        tensors = with_lora(tensors, 4, lora, value_head=arch.kind == "value")
    planned = train_state_bytes(
        tensors, layout.dp,
        layout.tp * layout.dp // (layout.ep * layout.etp), torch_dtype.itemsize, distributed,
        ranks=(groups.dp_rank, dist.get_rank(groups.collection.expt_dp)))
    return {"measured": measured_state(trainable),
            "planned": {"weights": planned.weights, "gradients": planned.gradients,
                        "optimizer": planned.optimizer}}


def saved_bytes(path: Path, options: ModelOptions, batch: int, seq: int,
                dtype: torch.dtype = torch.float32, packed: dict | None = None) -> dict:
    """Bytes autograd keeps for backward from the decoder's forward (weights excluded); with
    ``packed`` (a :func:`pack_token_grid` micro-batch) its rows, mask and RoPE positions."""
    arch = read_hf_arch(path)
    groups = layout_groups((1, 1, None, 1), arch.shape)
    model = build_model(arch, groups, dtype, padded_vocab_size(arch.vocab_size), options=options)
    model.train()
    weights = set(_storages(p.data for p in model.parameters()))
    kept = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    tokens = torch.randint(0, arch.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(5))
    mask = None
    if packed is not None:
        tokens, mask = packed["input_ids"], packed["attention_mask"]
        batch, seq = tokens.shape
        for module in _rotary_modules(model):  # what model_forward sets: RoPE per token
            module._rlhf_positions = packed.get("position_ids")
    positions = torch.arange(seq).expand(batch, seq)
    hidden = model.embedding(tokens, positions).detach().requires_grad_()
    rotary = model.rotary_pos_emb(seq) if getattr(model, "rotary_pos_emb", None) is not None else None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.decoder(hidden, attention_mask=mask, rotary_pos_emb=rotary)
    return {"measured": sum(kept.values()), "arch": arch}


def _activation_cases(where) -> dict:
    """label -> a call measuring what autograd saves and planning it (one process, no group)."""
    cases = {}

    def case(name, options, batch, seq, mode, dtype=torch.float32, rows=None, positions=False):
        def run():
            found = saved_bytes(where(name), options, batch, seq, dtype, packed=rows)
            shape = list(rows["input_ids"].shape) if rows is not None else [batch, seq]
            planned = decoder_saved_bytes(found["arch"], Workload(*shape, dtype.itemsize,
                                                                  packed=rows is not None,
                                                                  positions=positions), mode)
            return {"measured": found["measured"], "planned": planned,
                    **({"shape": shape} if rows is not None else {})}
        return run

    for name in ACTIVATION_MODELS:
        for mode, options in RECOMPUTE.items():
            for batch, seq in ((2, 64), (1, 96)):
                cases[f"saved/{name}/{mode}/b{batch}s{seq}"] = case(name, options, batch, seq, mode)
    for name in ("qwen2_policy", "deepseek_v3"):  # bf16: the softmax's fp32 copy (GQA and MLA)
        for batch, seq in ((2, 64), (1, 96)):
            cases[f"saved_bf16/{name}/b{batch}s{seq}"] = case(name, RECOMPUTE["none"], batch, seq,
                                                              "none", torch.bfloat16)
    # Packed rows (a dense mask) and shared prompts (RoPE per token): the shared-prompt test's
    # GRPO-like micro-batch, packed both ways, planned at the packed shape.
    for name in ACTIVATION_MODELS:
        for share in (False, True):
            rows = pack_token_grid(make_batch(), CAPACITY, share_prompts=share)
            for mode, options in RECOMPUTE.items():
                cases[f"saved_packed/{name}/{'shared' if share else 'packed'}/{mode}"] = case(
                    name, options, 0, 0, mode, rows=rows, positions=share)
    return cases


def main() -> None:
    models, families, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    init_distributed()
    where = lambda name: models / name if (models / name).is_dir() else families / name  # noqa: E731
    results = {}
    for label, (name, layout, dtype, distributed) in STATE_CASES.items():
        result = state_case(where(name), layout, dtype, distributed)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, result)
        results[f"state/{label}"] = everyone
    for label, (name, layout, dtype, distributed, targets) in LORA_CASES.items():
        result = state_case(where(name), layout, dtype, distributed, targets)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, result)
        results[f"state/{label}"] = everyone
    # The activation cases run in one process each (no collective): each rank measures its
    # share of them and the ranks pool their results.
    cases = list(_activation_cases(where).items())
    # Each case builds its groups (collectively): every rank must run as many cases.
    assert len(cases) % dist.get_world_size() == 0, f"{len(cases)} cases over {dist.get_world_size()} ranks"
    mine = dict(cases[dist.get_rank()::dist.get_world_size()])
    pooled = [None] * dist.get_world_size()
    dist.all_gather_object(pooled, {label: case() for label, case in mine.items()})
    for part in pooled:
        results.update(part)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=1))
    dist.barrier()


if __name__ == "__main__":
    main()
