"""Multi-process parity scenarios, run once under torchrun (4 ranks) by tests/test_parity.py.

Every layout of one world is tried in turn (the groups are rebuilt each time); rank 0 writes a
JSON of ``scenario -> max abs difference`` that the pytest side asserts on.
Usage: torchrun --nproc-per-node 4 tests/dist_parity.py MODELS_ROOT WORKDIR OUT.json
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rlhf.checkpoint.model_ckpt import load_model_checkpoint, read_checkpoint_info  # noqa: E402
from megatron_rlhf.convert.checkpoints import hf_to_mcore, read_hf_arch  # noqa: E402
from megatron_rlhf.checkpoint.hf_io import HFReader  # noqa: E402
from megatron_rlhf.convert.weights import load_hf_weights  # noqa: E402
from megatron_rlhf.distributed.launch import init_distributed  # noqa: E402
from megatron_rlhf.distributed.layout import ParallelLayout, build_parallel_groups  # noqa: E402
from megatron_rlhf.models.builder import build_model  # noqa: E402
from megatron_rlhf.models.forward import gather_vocab_parallel, pipeline_forward  # noqa: E402
from megatron_rlhf.models.hf_config import padded_vocab_size  # noqa: E402
from megatron_rlhf.rewards.rm_scorer import score_sequences  # noqa: E402

LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2), "tp4": (4, 1)}


def max_over_world(value: float | None) -> float:
    """Largest value any rank reports (ranks without an output report None); NaN when no rank
    reports one, so that every bar (``<``, ``>``, ``==``) compared with it fails."""
    reported = value is not None
    tensor = torch.tensor([float(value) if reported else -math.inf, float(reported)],
                          dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor[0].item() if tensor[1].item() else math.nan


def logits_of(model, groups, tokens, vocab):
    outputs = pipeline_forward(model, groups, [{"input_ids": tokens}],
                               lambda out, _: gather_vocab_parallel(out, groups)[..., :vocab])
    return outputs[0] if outputs else None


def release_groups() -> None:
    """Destroy every process group but the world's, before the next layout's groups.

    build_parallel_groups (megatron's destroy_model_parallel) only forgets the previous groups,
    which is enough for a job that builds one layout; a scenario building dozens in one process
    must free them: each gloo group keeps its threads (pt_gloo_runloop, gloo_tcp_loop) to the end
    of the process. The 40-odd layouts of dist_families.py had left ~1,800 threads per rank, and
    the scenario spent 7 of its 10 CPU minutes in the kernel: 310 s on 2 cores, 48 s with the
    groups freed (~145 threads per rank).
    """
    from torch.distributed.distributed_c10d import _get_default_group, _world

    world = _get_default_group()
    for group in [g for g in _world.pg_map if g is not world]:
        dist.destroy_process_group(group)


def write_results_and_leave(out: Path, results: dict) -> None:
    """Rank 0 writes a scenario's ``results`` to ``out`` (what tests/torchrun.py reads); then
    every rank leaves the world together."""
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def layout_groups(layout: tuple, shape, release: bool = True):
    """The groups of ``layout`` (``ParallelLayout``'s positional fields), the previous ones freed
    unless ``release`` is False (a DTensor engine's mesh over the same ranks, made after a
    release, still names the freed groups)."""
    if release:
        release_groups()
    return build_parallel_groups(ParallelLayout(*layout), shape)


def from_hf(hf_dir, layout, release: bool = True, options=None):
    arch = read_hf_arch(hf_dir)
    groups = layout_groups(layout, arch.shape, release)
    padded = padded_vocab_size(arch.vocab_size, groups.layout.tp)
    model = build_model(arch, groups, torch.float32, padded, options)
    load_hf_weights(model, HFReader(hf_dir), arch, groups, padded, progress=False)
    return model, groups, arch


def logits_parity(root: Path, results: dict) -> None:
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(0, 250, (3, 17), generator=torch.Generator().manual_seed(0))
    for name in ("qwen2_policy", "llama_policy", "qwen2_tied"):
        hf = AutoModelForCausalLM.from_pretrained(root / name).eval()
        with torch.no_grad():
            reference = hf(tokens).logits
        for label, layout in LAYOUTS.items():
            if name == "qwen2_policy" and layout[0] == 4:
                continue  # 2 KV heads cannot split 4 ways (the layout check refuses it)
            model, groups, arch = from_hf(root / name, layout)
            logits = logits_of(model, groups, tokens, arch.vocab_size)
            diff = None if logits is None else (logits - reference).abs().max().item()
            results[f"logits/{name}/{label}"] = max_over_world(diff)


def checkpoint_reshard(root: Path, workdir: Path, results: dict) -> None:
    """Save at TP=2, reload at TP=1 and PP=2: logits must match the TP=2 model's."""
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(0, 250, (2, 11), generator=torch.Generator().manual_seed(1))
    ckpt = workdir / "qwen2_tp2"
    release_groups()
    hf_to_mcore(str(root / "qwen2_policy"), str(ckpt), ParallelLayout(tp=2))
    info = read_checkpoint_info(ckpt)
    saved = None
    for label, layout in (("tp2", (2, 1)), ("tp1", (1, 1)), ("pp2", (1, 2))):
        groups = layout_groups(layout, info.arch.shape)
        model = load_model_checkpoint(info, groups)
        logits = logits_of(model, groups, tokens, info.arch.vocab_size)
        # Every rank gets the full tensor so any rank can compare.
        owner = 1.0 if logits is not None else 0.0
        buffer = logits.contiguous() if logits is not None else torch.zeros(2, 11, info.arch.vocab_size)
        flags = [torch.zeros(1) for _ in range(dist.get_world_size())]
        dist.all_gather(flags, torch.tensor([owner]))
        src = [i for i, flag in enumerate(flags) if flag.item() == 1.0][0]
        dist.broadcast(buffer, src=src)
        if saved is None:
            saved = buffer.clone()
        else:
            results[f"ckpt/tp2->{label}"] = (buffer - saved).abs().max().item()
    # The streamed import itself, each TP rank writing its own shards: the model it wrote.
    hf = AutoModelForCausalLM.from_pretrained(root / "qwen2_policy").eval()
    with torch.no_grad():
        results["ckpt/tp2_import_vs_hf"] = (saved - hf(tokens).logits).abs().max().item()


def reward_parity(root: Path, results: dict) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    for name in ("qwen2_rm", "llama_rm"):
        tokenizer = AutoTokenizer.from_pretrained(root / name)
        hf = AutoModelForSequenceClassification.from_pretrained(root / name).eval()
        texts = ["what is 3 plus 4? the answer is 7.", "what is 1 plus 1?", "hello", "7 8 9 10 11"]
        sequences = [tokenizer(text)["input_ids"] for text in texts]
        with torch.no_grad():
            reference = torch.tensor([hf(torch.tensor([s])).logits[0, 0].item() for s in sequences])
        for label in ("tp1", "tp2", "pp2"):
            model, groups, _ = from_hf(root / name, LAYOUTS[label])
            scores = score_sequences(model, groups, sequences, micro_batch_size=3,
                                     pad_id=tokenizer.pad_token_id, progress=False)
            diff = (torch.tensor(scores) - reference).abs().max().item() if scores else None
            results[f"reward/{name}/{label}"] = max_over_world(diff)


def unused_tensor_refused(root: Path, workdir: Path, results: dict) -> None:
    """An HF tensor no stage maps (here an extra one) is refused at PP=2 too, on every rank."""
    import shutil

    from safetensors.torch import load_file, save_file

    from megatron_rlhf.errors import UserError

    extra = workdir / "qwen2_extra"
    if dist.get_rank() == 0:
        shutil.copytree(root / "qwen2_policy", extra, dirs_exist_ok=True)
        tensors = load_file(extra / "model.safetensors")
        save_file({**tensors, "model.extra_norm.weight": torch.ones(4)}, extra / "model.safetensors")
    dist.barrier()
    try:
        from_hf(extra, LAYOUTS["pp2"])
        refused = 0.0
    except UserError as err:
        refused = float("model.extra_norm.weight" in str(err))
    flag = torch.tensor([refused])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    results["load/pp2_unused_tensor_refused"] = flag.item()


def main() -> None:
    root, workdir, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    init_distributed()
    results: dict[str, float] = {}
    logits_parity(root, results)
    checkpoint_reshard(root, workdir, results)
    reward_parity(root, results)
    unused_tensor_refused(root, workdir, results)
    write_results_and_leave(out, results)


if __name__ == "__main__":
    main()
