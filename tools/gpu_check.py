"""GPU checks, one process and one GPU (nccl world of 1), no Ray: what a lent GPU machine can run.

1. import: a random model with a config of configs/models/ (the planner's fixtures; cut to its
   first ``--layers`` layers to fit one GPU) or a tiny Qwen2, written as an HF folder and loaded
   into Megatron-Core; log-probs of the same tokens, Megatron vs transformers, fp32 and bf16.
2. train: bf16 training steps through the trainers' own engine (megatron DDP + optimizer,
   cross-entropy on every position): tokens/s, model TFLOP/s and MFU, peak memory against the
   planner's estimate of the same step (``megatron-rlhf plan``'s terms).
3. rollout: the ``hf`` rollout engine on the GPU (bf16 and fp32), and SGLang (bf16) when it is
   installed, fed by the resharding weight sync from the trained model; the engine's log-probs of
   its own greedy samples vs the trainer's of the same tokens, and the engine's decode rate. A
   second check: the trained weights synced into a transformers model score fixed tokens as
   Megatron does (weights after a sync). The SGLang branch has never run (SGLang cannot be
   carried to the GPU machines lent so far).

Every section is guarded: a failure is recorded (with its traceback) and the next one still runs.
Usage: python tools/gpu_check.py --out RESULT.json [--model configs/models/qwen3-8b --layers 8]
(``tools/gpu_check.sh`` installs the carried wheels and runs it on the device machine.)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PEAK_BF16_TFLOPS = 989.4  # H100/H200 SXM dense bf16, vendor datasheet
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=512, tie_word_embeddings=True)


def write_hf_model(folder: Path, model: str, layers: int | None, device: str) -> int:
    """A random causal LM (bf16 safetensors) with the config of ``model`` (a folder holding a
    config.json, e.g. the planner's configs/models/qwen3-8b, or ``tiny``), cut to its first
    ``layers`` layers when given. Returns the vocabulary size."""
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

    if model == "tiny":
        config = Qwen2Config(**TINY)
    else:
        config = AutoConfig.from_pretrained(model)
    config.num_hidden_layers = layers or config.num_hidden_layers
    if hasattr(config, "max_window_layers"):
        config.max_window_layers = config.num_hidden_layers
    config.max_position_embeddings = 4096
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 0, 1, 0
    torch.manual_seed(0)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    hf.save_pretrained(folder)
    return config.vocab_size


def megatron_model(hf_dir: Path, dtype: torch.dtype):
    from megatron_rlhf.checkpoint.hf_io import HFReader
    from megatron_rlhf.convert.checkpoints import read_hf_arch
    from megatron_rlhf.convert.weights import load_hf_weights
    from megatron_rlhf.distributed.layout import ParallelLayout, build_parallel_groups
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.models.hf_config import padded_vocab_size

    arch = read_hf_arch(hf_dir)
    groups = build_parallel_groups(ParallelLayout(), arch.shape)
    padded = padded_vocab_size(arch.vocab_size, 1)
    model = build_model(arch, groups, dtype, padded)
    load_hf_weights(model, HFReader(hf_dir), arch, groups, padded, progress=False)
    return model, groups, arch, padded


def megatron_logprobs(model, groups, arch, tokens: torch.Tensor) -> torch.Tensor:
    """``log p(tokens[:, 1:])`` ``[b, t-1]`` from the Megatron model (float32 softmax)."""
    from megatron_rlhf.models.forward import pipeline_forward
    from megatron_rlhf.trainers.rl.losses import token_logprobs

    targets = torch.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    head = lambda out, b: token_logprobs(out, b["targets"], arch.vocab_size, groups)  # noqa: E731
    out = pipeline_forward(model, groups, [{"input_ids": tokens, "targets": targets}], head)
    return out[0][:, :-1].float()


@torch.no_grad()
def hf_logprobs(hf_model, tokens: torch.Tensor) -> torch.Tensor:
    logits = hf_model(tokens.to(hf_model.device)).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None].to(logits.device))[..., 0]


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.float().cpu(), b.float().cpu()
    diff = (a - b).abs()
    return {"max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(),
            "mean_logprob": a.mean().item()}


def check_import(hf_dir: Path, device: str, tokens: torch.Tensor) -> dict:
    from transformers import AutoModelForCausalLM

    result = {}
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device).eval()
        reference = hf_logprobs(hf, tokens)
        del hf
        model, groups, arch, _ = megatron_model(hf_dir, dtype)
        result[label] = compare(megatron_logprobs(model, groups, arch, tokens), reference)
        del model
        _free(device)
    return result


def _free(device: str) -> None:
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def model_flops_per_token(arch, seq: int) -> float:
    """Training FLOPs per token: 6 x (layer + LM-head parameters) + 12 x layers x hidden x seq
    (attention scores and values, forward and backward; PaLM's count, no causal discount)."""
    h, layers = arch.hidden_size, arch.num_layers
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_query_groups * arch.head_dim
    per_layer = h * q * 2 + h * kv * 2 + 3 * h * arch.ffn_hidden_size
    return 6 * (layers * per_layer + h * arch.vocab_size) + 12 * layers * h * seq


def check_train(hf_dir: Path, device: str, seq: int, micro: int, micro_batches: int, steps: int,
                data: torch.Tensor):
    """bf16 steps on ``data`` rows (the same rows every step, so the loss falls)."""
    from megatron_rlhf.config.schema import OptimConfig
    from megatron_rlhf.models.forward import token_cross_entropy
    from megatron_rlhf.trainers.engine import make_trainable, train_step

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model, groups, arch, padded = megatron_model(hf_dir, torch.bfloat16)
    trainable = make_trainable(model, groups, OptimConfig(lr=3e-4, warmup_steps_ratio=0.0),
                               total_steps=steps + 2)

    def loss_fn(output, batch):
        loss = token_cross_entropy(output, batch["targets"], arch.vocab_size, groups).mean()
        return loss, {"loss": loss.detach()}

    batches = []
    for i in range(micro_batches):
        rows = data[i * micro:(i + 1) * micro]
        targets = torch.roll(rows, -1, dims=1)
        batches.append({"input_ids": rows, "targets": targets})
    times, losses = [], []
    warmup = 2
    for step in range(warmup + steps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = train_step(trainable, batches, loss_fn)
        if device == "cuda":
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
        losses.append(sum(m["loss"].item() for m in result.metrics) / len(result.metrics))
        print(f"[gpu_check] train step {step + 1}/{warmup + steps}: loss {losses[-1]:.4f} "
              f"{time.perf_counter() - start:.3f} s", flush=True)
    tokens = seq * micro * micro_batches
    step_s = sorted(times)[len(times) // 2]
    flops = model_flops_per_token(arch, seq)
    tflops = flops * tokens / step_s / 1e12
    # The decoder's matmul weights as the model holds them (2-D tensors), a count independent of
    # the formula above for the test to check it against.
    layer_matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and ".layers." in n)
    stats = {"seq": seq, "micro_batch_rows": micro, "micro_batches": micro_batches,
             "tokens_per_step": tokens, "median_step_s": step_s, "tokens_per_s": tokens / step_s,
             "model_flops_per_token": flops, "model_tflops": tflops,
             "mfu_vs_989": tflops / PEAK_BF16_TFLOPS, "layer_matmul_params": layer_matmul,
             "hidden": arch.hidden_size, "layers": arch.num_layers, "vocab": arch.vocab_size,
             "losses": losses, "params": sum(p.numel() for p in model.parameters())}
    planned = planned_bytes(arch, seq, micro, micro_batches)
    stats["planned_gib"] = {k: v / 2 ** 30 for k, v in planned.items()}
    if device == "cuda":
        stats["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        stats["planned_over_measured"] = planned["total"] / torch.cuda.max_memory_allocated()
    return stats, trainable, groups, arch, padded


def check_offload(trainable, device: str, planned_gib: dict, rounds: int = 3) -> dict:
    """Each offload switch alone on the trained bf16 model: the device bytes it frees (CUDA's
    allocator on a GPU, the storages' own sizes on CPU), the seconds out and back (median of
    ``rounds``), against the planner's term for the same state; then all three at once."""
    from megatron_rlhf.trainers.offload import Offloader

    offloader = Offloader.of(trainable)
    terms = {"params": "weights", "grads": "gradients", "optimizer": "optimizer"}
    out = {}
    for parts in (("params",), ("grads",), ("optimizer",), ("params", "grads", "optimizer")):
        switch = dict.fromkeys(parts, True)
        held = sum(offloader.resident_bytes(p) for p in parts)
        outs, backs, freed = [], [], []
        for _ in range(rounds):
            before = torch.cuda.memory_allocated() if device == "cuda" else held
            moved = offloader.offload(**switch)
            after = torch.cuda.memory_allocated() if device == "cuda" else \
                sum(offloader.resident_bytes(p) for p in parts)
            freed.append(before - after)
            outs.append(moved.seconds)
            backs.append(offloader.reload(**switch).seconds)
        name = "+".join(parts)
        out[name] = {"resident_gib": held / 2 ** 30, "freed_gib": min(freed) / 2 ** 30,
                     "seconds_out": sorted(outs)[rounds // 2], "seconds_in": sorted(backs)[rounds // 2],
                     "planned_gib": sum(planned_gib.get(terms[p], 0.0) for p in parts)}
        print(f"[gpu_check] offload {name}: frees {out[name]['freed_gib']:.3f} GiB "
              f"(planned {out[name]['planned_gib']:.3f}), out {out[name]['seconds_out']:.3f} s, "
              f"back {out[name]['seconds_in']:.3f} s", flush=True)
    return out


def planned_bytes(arch, seq: int, micro: int, micro_batches: int) -> dict:
    """The planner's per-GPU bytes of this step: one rank, bf16, no recompute, Adam without the
    distributed optimizer (what ``make_trainable`` builds by default)."""
    from megatron_rlhf.distributed.layout import ParallelLayout
    from megatron_rlhf.models.builder import uses_transformer_engine
    from megatron_rlhf.planning.plan import Hardware, Run, evaluate

    run = Run(job="sft", seq=seq, micro_batch=micro, global_batch=micro * micro_batches,
              recompute="none", distributed_optimizer=False, param_bytes=2,
              kernels="te" if uses_transformer_engine() else "local")
    plan = evaluate(arch, ParallelLayout(1, 1, 1), Hardware(1, 1, 141.0), run)
    return {**plan.terms, "total": plan.total}


def engine_gap(model, groups, arch, prompts, generations) -> dict:
    from megatron_rlhf.trainers.rl.experience import build_batch
    from megatron_rlhf.models.forward import pipeline_forward
    from megatron_rlhf.trainers.rl.losses import token_logprobs

    batch = build_batch([tuple(p) for p in prompts], generations, pad_id=0)
    head = lambda out, b: token_logprobs(out, b["targets"], arch.vocab_size, groups)  # noqa: E731
    trainer = pipeline_forward(model, groups, [batch], head)[0].float().cpu()
    engine = torch.zeros_like(trainer)
    for row, gen in enumerate(generations):
        start = len(prompts[gen.prompt_index]) - 1
        engine[row, start:start + len(gen.tokens)] = torch.tensor(gen.logprobs)
    mask = batch["loss_mask"].bool()
    diff = (engine - trainer)[mask].abs()
    return {"max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(),
            "tokens": int(mask.sum()), "mean_logprob": trainer[mask].mean().item()}


def _engines(hf_dir: Path, device: str):
    """(label, dtype, factory) of every rollout engine this machine can run: the ``hf`` engine in
    bf16 and fp32, and SGLang in bf16 when it is installed."""
    import importlib.util

    from megatron_rlhf.rollout.hf_engine import HFGenerator

    found = [(f"hf_{name}", dtype, lambda dtype=dtype: HFGenerator(str(hf_dir), dtype, pad_id=0,
                                                                   eos_id=1, device=device))
             for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32))]
    if device == "cuda" and importlib.util.find_spec("sglang") is not None:
        from megatron_rlhf.config.ppo_schema import RolloutConfig
        from megatron_rlhf.rollout.engines import place_engines
        from megatron_rlhf.rollout.sglang_engine import SGLangGenerator

        config = RolloutConfig(backend="sglang", tp=1, gpu_memory_utilization=0.3)
        found.append(("sglang_bf16", torch.bfloat16,
                      lambda: SGLangGenerator(str(hf_dir), config, torch.bfloat16, eos_id=1,
                                              slot=place_engines(1))))
    return found


def check_rollout(hf_dir: Path, device: str, trainable, groups, arch, padded, prompts, new_tokens,
                  probe: torch.Tensor) -> dict:
    """Weight sync into each engine of :func:`_engines` (fp32: an fp32 copy of the same weights)."""
    from megatron_rlhf.rollout.base import SamplingParams
    from megatron_rlhf.rollout.weight_sync import WeightSync

    model = trainable.module
    result = {}
    for label, dtype, make in _engines(hf_dir, device):
        engine = make()
        engine.release_memory()
        engine.resume_memory()
        if dtype == torch.float32:
            # The same (bf16-trained) weights in fp32 on both sides: only kernels differ.
            sync_model, sync_groups = _fp32_copy(hf_dir, model, device)
        else:
            sync_model, sync_groups = model, groups
        start = time.perf_counter()
        stats = WeightSync(sync_model, arch, sync_groups, padded, 256 * 2 ** 20).sync(engine.load_weights)
        if device == "cuda":
            torch.cuda.synchronize()
        sync_s = time.perf_counter() - start
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
        engine.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        generations = engine.generate(prompts, params)
        if device == "cuda":
            torch.cuda.synchronize()
        gen_s = time.perf_counter() - start
        produced = sum(len(g.tokens) for g in generations)
        entry = engine_gap(sync_model, sync_groups, arch, prompts, generations)
        entry.update(sync_s=sync_s, sync_bytes=stats["bytes"], sync_buckets=stats["buckets"],
                     generated_tokens=produced, decode_tokens_per_s=produced / gen_s)
        if hasattr(engine, "model"):  # a transformers model: score fixed tokens too
            entry["fixed_tokens"] = compare(megatron_logprobs(sync_model, sync_groups, arch, probe),
                                            hf_logprobs(engine.model, probe))
        result[label] = entry
        engine.release_memory()
        del engine
        _free(device)
    return result


def _fp32_copy(hf_dir: Path, model, device: str):
    """An fp32 Megatron model holding ``model``'s (bf16) weights."""
    from megatron_rlhf.distributed.layout import ParallelLayout, build_parallel_groups
    from megatron_rlhf.convert.checkpoints import read_hf_arch
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.models.hf_config import padded_vocab_size

    arch = read_hf_arch(hf_dir)
    groups = build_parallel_groups(ParallelLayout(), arch.shape)
    copy = build_model(arch, groups, torch.float32, padded_vocab_size(arch.vocab_size, 1))
    source = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in copy.named_parameters():
            param.copy_(source[name].float())
    return copy, groups


def guarded(results: dict, name: str, fn, *args):
    start = time.perf_counter()
    print(f"[gpu_check] {name} ...", flush=True)
    try:
        value = fn(*args)
        results[name] = value[0] if isinstance(value, tuple) else value
        return value
    except Exception:  # noqa: BLE001 - every section reports, the next still runs
        results[name] = {"error": traceback.format_exc()[-3000:]}
        print(results[name]["error"], flush=True)
        return None
    finally:
        print(f"[gpu_check] {name}: {time.perf_counter() - start:.1f} s", flush=True)


def environment(device: str) -> dict:
    import megatron.core
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__,
           "megatron_core": megatron.core.__version__, "device": device}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    from megatron_rlhf.models.builder import uses_transformer_engine

    env["transformer_engine"] = uses_transformer_engine()
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="tiny",
                        help="a folder with a config.json (configs/models/...) or 'tiny'")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=4, help="rows per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (after 2 warm-up)")
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()

    from megatron_rlhf.distributed.launch import init_distributed

    init_distributed()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {"model": args.model, "layers": args.layers, "env": environment(device)}
    tmp = tempfile.TemporaryDirectory()
    hf_dir = Path(tmp.name) / "hf"
    vocab = guarded(results, "write_hf_model", write_hf_model, hf_dir, args.model, args.layers,
                    device)
    if not isinstance(vocab, int):
        Path(args.out).write_text(json.dumps(results, indent=2, default=str))
        return 1
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(2, vocab, (args.micro * args.micro_batches, args.seq), generator=gen)
    width = min(256, args.seq)
    probe = torch.cat([data[:2, :width], torch.randint(2, vocab, (2, width), generator=gen)])
    prompts = [data[i % len(data), :min(16 + 8 * i, args.seq)].tolist() for i in range(8)]
    guarded(results, "import", check_import, hf_dir, device, probe)
    trained = guarded(results, "train", check_train, hf_dir, device, args.seq, args.micro,
                      args.micro_batches, args.steps, data)
    if trained is not None:
        guarded(results, "offload", check_offload, trained[1], device, trained[0]["planned_gib"])
        guarded(results, "rollout", check_rollout, hf_dir, device, *trained[1:], prompts,
                args.new_tokens, probe)
    tmp.cleanup()
    Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    print(json.dumps(results, indent=2, default=str), flush=True)
    failed = [k for k, v in results.items() if isinstance(v, dict) and "error" in v]
    print(f"[gpu_check] done; failed sections: {failed or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
