"""Weight-sync parity scenarios, run once under torchrun (2 ranks) by tests/test_weight_sync.py.

For each (trainer layout -> generator TP) the Megatron actor is loaded from a tiny HF model and
then perturbed (as an optimizer step would), the rollout engine starts with random weights, one
sync streams the actor into it, and the engine's log-probs of its own greedy generations are
compared with the trainer's log-probs of the same tokens (fp32).
Usage: torchrun --nproc-per-node 2 tests/dist_weight_sync.py MODELS_ROOT OUT.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rlhf.distributed.launch import init_distributed  # noqa: E402
from megatron_rlhf.models.forward import pipeline_forward  # noqa: E402
from megatron_rlhf.models.hf_config import padded_vocab_size  # noqa: E402
from megatron_rlhf.rollout.base import SamplingParams  # noqa: E402
from megatron_rlhf.rollout.engines import place_engines  # noqa: E402
from megatron_rlhf.rollout.hf_engine import HFGenerator  # noqa: E402
from megatron_rlhf.rollout.weight_sync import WeightSync  # noqa: E402
from megatron_rlhf.trainers.rl.experience import build_batch  # noqa: E402
from megatron_rlhf.trainers.rl.losses import token_logprobs  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_parity import from_hf, max_over_world, write_results_and_leave  # noqa: E402

PROMPTS = [[5, 17, 33, 8, 90], [44, 2, 61, 7, 19, 23, 120, 3, 77], [12, 9, 200]]

# name -> (model, (tp, pp), generator tp, bucket bytes)
SCENARIOS = {
    "tp2_to_gen_tp1": ("qwen2_policy", (2, 1), 1, 512 * 2 ** 20),
    "tp2_to_gen_tp2": ("qwen2_policy", (2, 1), 2, 512 * 2 ** 20),
    "pp2_to_gen_tp1": ("qwen2_policy", (1, 2), 1, 512 * 2 ** 20),
    "pp2_to_gen_tp2": ("qwen2_policy", (1, 2), 2, 512 * 2 ** 20),
    "tp2_small_bucket": ("qwen2_policy", (2, 1), 1, 4096),  # smaller than most tensors
    "llama_tied_pp2_to_gen_tp1": ("llama_policy", (1, 2), 1, 64 * 2 ** 10),
}


def perturb(model) -> None:
    """Move every weight as a training step would, identically on every rank."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            # Tied embeddings live on the first and the last stage; Megatron keeps both copies
            # equal (their gradients are all-reduced), so they move together here too.
            tied = name in ("embedding.word_embeddings.weight", "output_layer.weight")
            source = torch.Generator().manual_seed(11) if tied else generator
            param.add_(0.02 * torch.randn(param.shape, generator=source))


def trainer_logprobs(model, groups, batch, vocab):
    head = lambda out, b: token_logprobs(out, b["targets"], vocab, groups) * b["loss_mask"]  # noqa: E731
    out = pipeline_forward(model, groups, [batch], head)
    return out[0] if out else None


def gap(model, groups, arch, generations) -> float | None:
    """Max |engine log-prob - trainer log-prob| over the generated tokens (last stage only)."""
    batch = build_batch([tuple(p) for p in PROMPTS], generations, pad_id=0)
    reference = trainer_logprobs(model, groups, batch, arch.vocab_size)  # every rank: collective
    if reference is None:
        return None
    engine = torch.zeros_like(reference)
    for row, gen in enumerate(generations):
        start = len(PROMPTS[gen.prompt_index]) - 1
        engine[row, start:start + len(gen.tokens)] = torch.tensor(gen.logprobs)
    return (engine - reference)[batch["loss_mask"].bool()].abs().max().item()


def run_scenario(root: Path, model_name: str, layout, gen_tp: int, bucket: int) -> dict:
    model, groups, arch = from_hf(root / model_name, layout)
    perturb(model)
    padded = padded_vocab_size(arch.vocab_size, groups.layout.tp)
    engine = HFGenerator(str(root / model_name), torch.float32, pad_id=0, eos_id=1,
                         slot=place_engines(gen_tp))
    params = SamplingParams(max_tokens=8, temperature=0.0)
    before = engine.generate(PROMPTS, params)
    resident = engine.resident_bytes()
    engine.release_memory()  # as in training: the engine frees its weights, the sync refills them
    released = engine.resident_bytes()
    engine.resume_memory()
    sync = WeightSync(model, arch, groups, padded, bucket)
    stats = sync.sync(engine.load_weights)
    after = engine.generate(PROMPTS, params)
    diff = gap(model, groups, arch, after)
    before_gap = gap(model, groups, arch, before)  # the engine's random weights: far off
    return {"max_abs_diff": max_over_world(diff), "diff_before_sync": max_over_world(before_gap),
            "buckets": stats["buckets"], "bytes": stats["bytes"],
            "resident_bytes": resident, "released_bytes": released}


def payload_order() -> list | None:
    """What the SGLang backend's engine head gathers: one payload per rank of its engine, in
    the engine's member order (SGLang's TP ranks), whatever the ranks' numbers."""
    from megatron_rlhf.distributed.engine_placement import EngineSlot
    from megatron_rlhf.rollout.sglang_engine import gather_in_member_order

    slot = EngineSlot(0, 1, (1, 0), 1, None, ())  # rank 1 holds the engine's first GPU
    found = gather_in_member_order(f"payload of rank {dist.get_rank()}", slot, dist.group.WORLD)
    box = [found]
    dist.broadcast_object_list(box, src=1)
    return box[0]


def main() -> None:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    init_distributed()
    results = {name: run_scenario(root, *spec) for name, spec in SCENARIOS.items()}
    results["sglang_payload_order"] = payload_order()
    write_results_and_leave(out, results)


if __name__ == "__main__":
    main()
