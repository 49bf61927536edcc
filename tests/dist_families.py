"""Parity scenarios of the 2026 families (Qwen3, Qwen2/3-MoE, DeepSeek-V3, Llama 3.x RoPE), run
once under torchrun (4 ranks) by tests/test_families.py.

Logits of every family under TP=2, PP=2 and, for MoE models, EP=2, EP=4 and TP=2 x EP=2 against
transformers; EP layouts against EP=1; a checkpoint saved at EP=2 reloaded at other layouts; the
weight sync at EP=2 (and TP2 x EP2, PP2 x EP2): the
engine's log-probs of its own generations after one sync against the trainer's; and engines
spanning ranks (TP=2 fed by PP=2, TP=2 x EP=2 fed by EP=4, TP=2 with its experts split by
TP fed by TP=2 x EP=2) after two syncs.
Usage: torchrun --nproc-per-node 4 tests/dist_families.py MODELS_ROOT WORKDIR OUT.json
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist_parity import (from_hf, layout_groups, logits_of, max_over_world,  # noqa: E402
                         release_groups, write_results_and_leave)
from dist_weight_sync import gap, perturb  # noqa: E402

from megatron_rlhf.distributed.launch import init_distributed  # noqa: E402
from megatron_rlhf.models.hf_config import padded_vocab_size  # noqa: E402
from megatron_rlhf.rollout.base import SamplingParams  # noqa: E402
from megatron_rlhf.rollout.engines import place_engines  # noqa: E402
from megatron_rlhf.rollout.hf_engine import HFGenerator  # noqa: E402
from megatron_rlhf.rollout.weight_sync import WeightSync  # noqa: E402

# (tp, pp, dp, ep); dp is what the 4 ranks leave
DENSE = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}
EXPERTS = {"ep2": (1, 1, None, 2), "ep4": (1, 1, None, 4), "tp2ep2": (2, 1, None, 2)}
LAYOUTS = {
    "qwen3": DENSE, "llama3_rope": DENSE,
    "qwen2_moe": {**DENSE, **EXPERTS}, "qwen3_moe": {**DENSE, **EXPERTS},
    "deepseek_v3": {**DENSE, **EXPERTS},
    "deepseek_v3_no_q_lora": {"tp1": (1, 1), "tp2": (2, 1), "ep2": (1, 1, None, 2)},
    "deepseek_v3_yarn": {"tp1": (1, 1), "tp2": (2, 1)},
    # (tp, pp, dp, ep, etp, first stage, last stage): None = split automatically
    "qwen3_moe_3l": {"tp1": (1, 1), "pp2": (1, 2), "pp2ep2": (1, 2, None, 2)},
    "deepseek_v3_5l": {"tp1": (1, 1), "pp2": (1, 2), "pp4": (1, 4),
                       "pp2_3+2": (1, 2, None, 1, 1, 3, 2), "pp2ep2": (1, 2, None, 2)},
}
UNEVEN = ("qwen3_moe_3l", "deepseek_v3_5l")
# name -> (model, layout, generator tp)
SYNCS = {"qwen3_moe_ep2": ("qwen3_moe", (1, 1, None, 2)),
         "deepseek_v3_tp2ep2": ("deepseek_v3", (2, 1, None, 2)),
         "qwen2_moe_pp2ep2": ("qwen2_moe", (1, 2, None, 2)),
         "deepseek_v3_5l_pp2": ("deepseek_v3_5l", (1, 2)),
         "qwen3_moe_3l_pp2ep2": ("qwen3_moe_3l", (1, 2, None, 2))}
PROMPTS = [[5, 17, 33, 8, 90], [44, 2, 61, 7, 19, 23, 120, 3, 77], [12, 9, 200]]
# Engines spanning ranks, laid over the 4 ranks by the engine placement, two syncs each:
# name -> (model, trainer layout, engine GPUs, experts split over them)
ENGINE_SYNCS = {"qwen3_pp2_to_engine_tp2": ("qwen3", (1, 2), 2, False),
                "qwen3_moe_ep4_to_engine_tp2ep2": ("qwen3_moe", (1, 1, None, 4), 2, True),
                "qwen3_moe_tp2ep2_to_engine_tp2": ("qwen3_moe", (2, 1, None, 2), 2, False)}


def broadcast_logits(logits, shape):
    """The last stage's logits on every rank (any rank can then compare layouts)."""
    owner = torch.tensor([float(logits is not None)])
    flags = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(flags, owner)
    buffer = logits.contiguous() if logits is not None else torch.zeros(shape)
    dist.broadcast(buffer, src=[i for i, f in enumerate(flags) if f.item() == 1.0][0])
    return buffer


def logits_parity(root: Path, results: dict) -> None:
    from transformers import AutoModelForCausalLM

    # 150 tokens: past the 64-token original context of the scaled RoPE variants
    tokens = torch.randint(0, 250, (2, 150), generator=torch.Generator().manual_seed(0))
    for name, layouts in LAYOUTS.items():
        hf = AutoModelForCausalLM.from_pretrained(root / name).eval()
        with torch.no_grad():
            reference = hf(tokens).logits
        single = None
        for label, layout in layouts.items():
            model, groups, arch = from_hf(root / name, layout)
            logits = broadcast_logits(logits_of(model, groups, tokens, arch.vocab_size),
                                      reference.shape)
            results[f"logits/{name}/{label}"] = (logits - reference).abs().max().item()
            if label == "tp1":
                single = logits
            elif "ep" in label or name in UNEVEN:
                results[f"ep_vs_ep1/{name}/{label}"] = (logits - single).abs().max().item()
            if name in UNEVEN:
                results[f"stages/{name}/{label}"] = groups.layout.stage_layers(arch.num_layers)


def checkpoint_reshard(root: Path, workdir: Path, results: dict) -> None:
    """An MoE checkpoint saved at EP=2 loads at EP=1, TP=2, PP=2 and TP=2 x EP=2."""
    from megatron_rlhf.checkpoint.model_ckpt import load_model_checkpoint, read_checkpoint_info
    from megatron_rlhf.convert.checkpoints import hf_to_mcore
    from megatron_rlhf.distributed.layout import ParallelLayout

    tokens = torch.randint(0, 250, (2, 11), generator=torch.Generator().manual_seed(1))
    ckpt = workdir / "deepseek_v3_ep2"
    release_groups()
    hf_to_mcore(str(root / "deepseek_v3"), str(ckpt), ParallelLayout(ep=2))
    info = read_checkpoint_info(ckpt)
    saved = None
    for label, layout in (("ep2", (1, 1, None, 2)), ("ep1", (1, 1)), ("tp2", (2, 1)),
                          ("pp2", (1, 2)), ("tp2ep2", (2, 1, None, 2))):
        groups = layout_groups(layout, info.arch.shape)
        logits = broadcast_logits(logits_of(load_model_checkpoint(info, groups), groups, tokens,
                                            info.arch.vocab_size), (2, 11, info.arch.vocab_size))
        saved = logits if saved is None else saved
        results[f"ckpt/ep2->{label}"] = (logits - saved).abs().max().item()
    # The streamed import itself, each EP rank writing its own experts: the model it wrote.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(root / "deepseek_v3").eval()
    with torch.no_grad():
        results["ckpt/ep2_import_vs_hf"] = (saved - hf(tokens).logits).abs().max().item()


def uneven_checkpoint(root: Path, workdir: Path, results: dict) -> None:
    """DeepSeek-V3 with 5 layers imported at PP=2 (stages of 2 and 3 layers) reloads at PP=1,
    PP=4 (1+1+1+2) and PP=2 x EP=2; and back to HF from the uneven checkpoint, bitwise."""
    from megatron_rlhf.checkpoint.model_ckpt import load_model_checkpoint, read_checkpoint_info
    from megatron_rlhf.convert.checkpoints import hf_to_mcore, mcore_to_hf
    from megatron_rlhf.distributed.layout import ParallelLayout

    tokens = torch.randint(0, 250, (2, 11), generator=torch.Generator().manual_seed(2))
    ckpt = workdir / "deepseek_v3_5l_pp2"
    release_groups()
    hf_to_mcore(str(root / "deepseek_v3_5l"), str(ckpt), ParallelLayout(pp=2))
    info = read_checkpoint_info(ckpt)
    saved = None
    for label, layout in (("pp2", (1, 2)), ("pp1", (1, 1)), ("pp4", (1, 4)),
                          ("pp2ep2", (1, 2, None, 2))):
        groups = layout_groups(layout, info.arch.shape)
        logits = broadcast_logits(logits_of(load_model_checkpoint(info, groups), groups, tokens,
                                            info.arch.vocab_size), (2, 11, info.arch.vocab_size))
        saved = logits if saved is None else saved
        results[f"ckpt/uneven_pp2->{label}"] = (logits - saved).abs().max().item()
    release_groups()
    back = workdir / "deepseek_v3_5l_back"
    mcore_to_hf(str(ckpt), str(back))
    dist.barrier()
    from safetensors.torch import load_file

    if dist.get_rank() == 0:
        source = load_file(root / "deepseek_v3_5l" / "model.safetensors")
        written = {k: v for f in sorted(back.glob("*.safetensors")) for k, v in load_file(f).items()}
        results["ckpt/uneven_roundtrip_max_diff"] = max(
            (source[k] - written[k]).abs().max().item() for k in source if k in written)
        results["ckpt/uneven_roundtrip_missing"] = len(set(source) - set(written))


def sync_parity(root: Path, results: dict) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0)
    for label, (name, layout) in SYNCS.items():
        model, groups, arch = from_hf(root / name, layout)
        perturb(model)
        padded = padded_vocab_size(arch.vocab_size, groups.layout.tp)
        engine = HFGenerator(str(root / name), torch.float32, pad_id=0, eos_id=1)
        before = gap(model, groups, arch, engine.generate(PROMPTS, params))
        # Buckets smaller than one expert's weight: every such tensor must travel alone.
        plan = WeightSync(model, arch, groups, padded, 64 * 2 ** 10)
        expert_bytes = min(math.prod(shape) for b in plan.buckets for e in b if e.expert
                           for _, shape in e.hf) * 4
        sync = WeightSync(model, arch, groups, padded, expert_bytes // 2)
        stats = sync.sync(engine.load_weights)
        results[f"sync_bucket_over_expert/{label}"] = sync.bucket_bytes / expert_bytes
        after = gap(model, groups, arch, engine.generate(PROMPTS, params))
        results[f"sync/{label}"] = max_over_world(after)
        results[f"sync_before/{label}"] = max_over_world(before)
        results[f"sync_buckets/{label}"] = stats["buckets"]


def engine_sync_parity(root: Path, results: dict) -> None:
    """Engine log-probs equal the trainer's after each of two syncs (the trainer moved between
    them), with the engine split over 2 or 4 ranks as the placement lays it out."""
    params = SamplingParams(max_tokens=8, temperature=0.0)
    for index, (label, (name, layout, tp, experts)) in enumerate(ENGINE_SYNCS.items()):
        model, groups, arch = from_hf(root / name, layout, release=index == 0)
        padded = padded_vocab_size(arch.vocab_size, groups.layout.tp)
        engine = HFGenerator(str(root / name), torch.float32, pad_id=0, eos_id=1,
                             slot=place_engines(tp), expert_parallel=experts)
        sync = WeightSync(model, arch, groups, padded, 64 * 2 ** 10)
        results[f"engine_sync_before/{label}"] = max_over_world(
            gap(model, groups, arch, engine.generate(PROMPTS, params)))
        for attempt in (1, 2):
            perturb(model)
            sync.sync(engine.load_weights)
            results[f"engine_sync/{label}/{attempt}"] = max_over_world(
                gap(model, groups, arch, engine.generate(PROMPTS, params)))
        whole = sum(p.numel() for p in engine.model.parameters())  # DTensor: the full size
        results[f"engine_share/{label}"] = engine.resident_bytes() / (4 * whole)


# Every family trains: next-token loss over a fixed batch through megatron DDP + Adam (what SFT,
# the reward model and PPO's actor and critic step with), at TP=2 x DP=2 with sequence
# parallelism (megatron requires it for MoE with TP) and, for the MoE families, EP=2.
TRAIN = {"qwen3": (2, 1), "llama3_rope": (2, 1), "qwen2_moe": (2, 1, None, 2),
         "qwen3_moe": (2, 1, None, 2), "deepseek_v3": (2, 1, None, 2)}
TRAIN_STEPS = 6


def training(root: Path, results: dict) -> None:
    from megatron_rlhf.config.schema import OptimConfig
    from megatron_rlhf.models.forward import token_cross_entropy
    from megatron_rlhf.models.megatron_config import ModelOptions
    from megatron_rlhf.trainers.engine import make_trainable, train_step

    rows = torch.randint(0, 250, (4, 24), generator=torch.Generator().manual_seed(3))
    batches = [{"input_ids": rows[i:i + 2], "targets": torch.roll(rows[i:i + 2], -1, dims=1)}
               for i in (0, 2)]
    for name, layout in TRAIN.items():
        model, groups, arch = from_hf(root / name, layout,
                                      options=ModelOptions(sequence_parallel=True))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        trainable = make_trainable(model, groups, OptimConfig(lr=3e-3, warmup_steps_ratio=0.0),
                                   total_steps=TRAIN_STEPS)

        def loss_fn(output, batch):
            loss = token_cross_entropy(output, batch["targets"], arch.vocab_size, groups).mean()
            return loss, {"loss": loss.detach()}

        losses = []
        for _ in range(TRAIN_STEPS):
            result = train_step(trainable, batches, loss_fn)
            losses.append(sum(m["loss"].item() for m in result.metrics) / len(result.metrics))
        moved = sum(int(not torch.equal(p.detach(), before[n])) for n, p in model.named_parameters())
        results[f"train/{name}/first_loss"] = losses[0]
        results[f"train/{name}/last_loss"] = losses[-1]
        # Every parameter of this rank moved (experts included: each saw tokens).
        results[f"train/{name}/unmoved_params"] = max_over_world(float(len(before) - moved))


def gradient_parity(root: Path, results: dict) -> None:
    """One Adam step's gradients (reduced, clipped: what the optimizer applies) of every
    parameter at TP2 + SP with EP1 against TP1, gathered to full HF tensors by the weight sync's
    own gather. Two megatron-core 0.16.1 gaps fixed by this project show here: experts whole on
    every TP rank kept one rank's tokens' share, and MLA's rotary key lost other ranks' heads'."""
    from megatron_rlhf.config.schema import OptimConfig
    from megatron_rlhf.models.forward import token_cross_entropy
    from megatron_rlhf.models.megatron_config import ModelOptions
    from megatron_rlhf.trainers.engine import make_trainable, train_step

    rows = torch.randint(0, 250, (4, 24), generator=torch.Generator().manual_seed(5))
    batches = [{"input_ids": rows[i:i + 2], "targets": torch.roll(rows[i:i + 2], -1, dims=1)}
               for i in (0, 2)]
    for name in ("qwen3_moe", "deepseek_v3"):
        grads = {}
        for tp in (1, 2):
            model, groups, arch = from_hf(root / name, (tp, 1),
                                          options=ModelOptions(sequence_parallel=tp > 1))
            trainable = make_trainable(model, groups, OptimConfig(lr=1e-3, warmup_steps_ratio=0.0), 1)

            def loss_fn(output, batch):
                loss = token_cross_entropy(output, batch["targets"], arch.vocab_size, groups).mean()
                return loss, {"loss": loss.detach()}

            train_step(trainable, batches, loss_fn)
            with torch.no_grad():
                for param in model.parameters():
                    param.copy_(param.main_grad)
            sync = WeightSync(model, arch, groups, padded_vocab_size(arch.vocab_size, tp), 2 ** 24)
            grads[tp] = {k: v.clone() for bucket in sync.iter_buckets() for k, v in bucket}
        one, two = grads[1], grads[2]
        results[f"grad_parity/{name}/tensors"] = float(len(one) == len(two) == len(one.keys() & two.keys()))
        results[f"grad_parity/{name}/max_gap"] = max((one[k] - two[k]).abs().max().item() for k in one)
        results[f"grad_parity/{name}/max_grad"] = max(v.abs().max().item() for v in one.values())


def main() -> None:
    root, workdir, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    init_distributed()
    results: dict[str, float] = {}
    logits_parity(root, results)
    checkpoint_reshard(root, workdir, results)
    uneven_checkpoint(root, workdir, results)
    sync_parity(root, results)
    engine_sync_parity(root, results)
    training(root, results)
    gradient_parity(root, results)
    write_results_and_leave(out, results)


if __name__ == "__main__":
    main()
