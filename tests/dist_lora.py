"""LoRA scenarios under torchrun (2 ranks), run once by tests/test_lora.py.

Every layout trains the same adapters on the same batch for a few steps (a layout with data
parallelism feeds each DP rank the same micro-batches, so DDP's mean is the single-rank
gradient); rank 0 writes a JSON of ``scenario -> number`` the pytest side asserts on, and the
trained policy's PEFT export plus its logits for the transformers/PEFT comparison.
Usage: torchrun --nproc-per-node 2 tests/dist_lora.py MODELS_ROOT WORKDIR OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rlhf.checkpoint.model_ckpt import (load_model_checkpoint, read_checkpoint_info,  # noqa: E402
                                                  save_model_checkpoint)
from megatron_rlhf.config.schema import OptimConfig  # noqa: E402
from megatron_rlhf.convert.peft import export_peft, gathered_adapters  # noqa: E402
from megatron_rlhf.convert.streaming_export import export_hf  # noqa: E402
from megatron_rlhf.distributed.launch import init_distributed  # noqa: E402
from megatron_rlhf.errors import UserError  # noqa: E402
from megatron_rlhf.models.forward import token_cross_entropy  # noqa: E402
from megatron_rlhf.models.hf_config import padded_vocab_size  # noqa: E402
from megatron_rlhf.models.lora import LoRASpec, adapters, adapters_disabled, apply_lora  # noqa: E402
from megatron_rlhf.models.megatron_config import ModelOptions  # noqa: E402
from megatron_rlhf.trainers.engine import make_trainable, train_step  # noqa: E402
from tests.dist_parity import from_hf, layout_groups, logits_of, max_over_world  # noqa: E402

SPEC = LoRASpec(rank=4, alpha=8.0, seed=3)
STEPS = 3
# label -> (tp, pp), sequence parallel, distributed optimizer
LAYOUTS = {"tp1": ((1, 1), False, False), "tp2": ((2, 1), False, False),
           "tp2sp": ((2, 1), True, False), "pp2": ((1, 2), False, False),
           "tp1_distopt": ((1, 1), False, True)}
EXPORT = {"qwen2_policy": "tp2sp", "llama_policy": "tp2"}  # the layout whose adapters go to PEFT
OPTIM = OptimConfig(lr=1e-2, warmup_steps_ratio=0.0, clip_grad=1.0, betas=[0.9, 0.99])


def batches() -> list[dict]:
    tokens = torch.randint(0, 250, (4, 13), generator=torch.Generator().manual_seed(7))
    return [{"input_ids": tokens[i:i + 2, :-1], "targets": tokens[i:i + 2, 1:]} for i in (0, 2)]


def mean_loss(vocab, groups):
    def loss(logits, batch):
        rows, length = logits.shape[:2]
        per_token = token_cross_entropy(logits, batch["targets"][:rows, :length], vocab, groups)
        return per_token.mean(), {"loss": per_token.mean().detach()}
    return loss


def expected_trainable(arch, tp: int, pp: int) -> int:
    """This rank's adapter numbers by the formulas of the brief (not read from the model)."""
    h, r, ffn = arch.hidden_size, SPEC.rank, arch.ffn_hidden_size
    qkv = (arch.num_attention_heads + 2 * arch.num_query_groups) * arch.head_dim
    per_layer = (r * h + qkv // tp * r) + (r * h // tp + h * r) \
        + (r * h + 2 * ffn // tp * r) + (r * ffn // tp + h * r)
    return per_layer * arch.num_layers // pp


def optimizer_numel(trainable, distributed: bool) -> int:
    """Elements the optimizer updates (summed over DP ranks when it shards them)."""
    numel = torch.tensor([sum(p.numel() for g in trainable.optimizer.param_groups
                              for p in g["params"])], dtype=torch.float64)
    if distributed:
        dist.all_reduce(numel, group=trainable.groups.dp)
    return int(numel.item())


def adapter_ids(model) -> set[int]:
    return {id(p) for _, a in adapters(model) for p in (a.lora_a, a.lora_b)}


def run_layout(root: Path, name: str, label: str, results: dict, reference: dict) -> None:
    (tp, pp), sp, distopt = LAYOUTS[label]
    model, groups, arch = from_hf(root / name, (tp, pp), options=ModelOptions(sequence_parallel=sp))
    padded = padded_vocab_size(arch.vocab_size, tp)
    tokens = batches()[0]["input_ids"]
    base = logits_of(model, groups, tokens, arch.vocab_size)
    apply_lora(model, SPEC)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    key = f"{name}/{label}"
    step0 = logits_of(model, groups, tokens, arch.vocab_size)
    results[f"{key}/step0_vs_base"] = max_over_world(
        None if base is None else (step0 - base).abs().max().item())
    trainable = make_trainable(model, groups, OPTIM, STEPS, distributed_optimizer=distopt)
    buffered = {id(p) for buf in trainable.model.buffers for p in buf.params}
    results[f"{key}/ddp_params_are_adapters"] = float(buffered == adapter_ids(model))
    results[f"{key}/optimizer_numel_minus_expected"] = float(
        optimizer_numel(trainable, distopt) - expected_trainable(arch, tp, pp))
    for _ in range(STEPS):
        train_step(trainable, batches(), mean_loss(arch.vocab_size, groups))
    unchanged = all(torch.equal(frozen[n], p) for n, p in model.named_parameters() if n in frozen)
    flag = torch.tensor([float(unchanged)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    results[f"{key}/base_bitwise_unchanged"] = flag.item()
    trained = {"logits": logits_of(model, groups, tokens, arch.vocab_size),
               "weights": gathered_adapters(model, arch, groups, padded)}
    if not distopt:  # the distributed optimizer leaves only each rank's gradient shard reduced
        trained["grads"] = gathered_adapters(model, arch, groups, padded, field="main_grad")
    with adapters_disabled(model):
        off = logits_of(model, groups, tokens, arch.vocab_size)
    results[f"{key}/disabled_vs_base"] = max_over_world(
        None if base is None else (off - base).abs().max().item())
    compare(key, trained, reference, results)
    if EXPORT.get(name) == label:
        export_trained(root, name, model, groups, arch, padded, trained["logits"], tokens)
    if name == "qwen2_policy" and label == "tp2":
        save_model_checkpoint(model, Path(sys.argv[2]) / "ckpt_tp2", arch, padded, torch.float32,
                              root / name, lora=SPEC)
        reshard_checkpoint(Path(sys.argv[2]) / "ckpt_tp2", trained["logits"], tokens, results)
        export_merged(Path(sys.argv[2]), trained["logits"], tokens)


def compare(key: str, trained: dict, reference: dict, results: dict) -> None:
    """Against the TP1 run's (kept in ``reference``); the TP1 run records itself."""
    weights = trained["weights"]
    results[f"{key}/max_abs_lora_B"] = max(v.abs().max().item() for k, v in weights.items()
                                           if "lora_B" in k)
    results[f"{key}/peft_tensors"] = float(len(weights))
    if not reference:
        reference.update(trained)
        return
    logits = trained["logits"]
    results[f"{key}/logits_vs_tp1"] = max_over_world(
        None if logits is None or reference["logits"] is None
        else (logits - reference["logits"]).abs().max().item())
    results[f"{key}/weights_vs_tp1"] = max((weights[k] - reference["weights"][k]).abs().max().item()
                                           for k in reference["weights"])
    if "grads" in trained:
        results[f"{key}/grads_vs_tp1"] = max(
            (trained["grads"][k] - reference["grads"][k]).abs().max().item()
            for k in reference["grads"])
        results[f"{key}/max_abs_grad"] = max(v.abs().max().item() for v in trained["grads"].values())


def export_trained(root: Path, name: str, model, groups, arch, padded, logits, tokens) -> None:
    out = Path(sys.argv[2]) / f"peft_{name}"
    export_peft(model, arch, groups, padded, SPEC, out, base_model=str(root / name))
    if logits is not None and groups.tp_rank == 0 and groups.dp_rank == 0:
        torch.save({"tokens": tokens, "logits": logits}, out / "megatron_logits.pt")
    dist.barrier()


def reshard_checkpoint(path: Path, logits: torch.Tensor, tokens, results: dict) -> None:
    """The TP2-trained adapters saved with the base reload at TP1 and PP2: as adapters, and
    merged into the weights (a plain model, what exports and later stages get)."""
    info = read_checkpoint_info(path)
    results["ckpt/lora_spec_recorded"] = float(info.lora == SPEC)
    for label, layout in (("tp1", (1, 1)), ("pp2", (1, 2)), ("tp2", (2, 1))):
        for keep in (True, False):
            groups = layout_groups(layout, info.arch.shape)
            model = load_model_checkpoint(info, groups, keep_adapters=keep)
            got = logits_of(model, groups, tokens, info.arch.vocab_size)
            kind = "adapters" if keep else "merged"
            results[f"ckpt/tp2->{label}/{kind}"] = max_over_world(
                None if got is None else (got - logits).abs().max().item())
            if not keep:
                plain = not any(True for _ in adapters(model)) and all(
                    p.requires_grad for p in model.parameters())
                results[f"ckpt/tp2->{label}/merged_is_plain"] = float(plain)


def export_merged(work: Path, logits: torch.Tensor, tokens) -> None:
    """``convert mcore-to-hf``'s streaming export of the LoRA checkpoint: adapters merged."""
    info = read_checkpoint_info(work / "ckpt_tp2")
    export_hf(info, work / "hf_merged", layout_groups((1, 1), info.arch.shape), 2**20)
    if dist.get_rank() == 0:
        torch.save({"tokens": tokens, "logits": logits}, work / "hf_merged_logits.pt")
    dist.barrier()


def refusals(root: Path, results: dict) -> None:
    """Each bad setting raises one UserError naming the problem (on every rank)."""
    cases = {"rank_wider_than_layer": LoRASpec(rank=65),
             "mla_target": LoRASpec(rank=2, target_modules=("linear_kv_up_proj",)),
             "unknown_target": LoRASpec(rank=2, target_modules=("q_proj",))}
    for label, spec in cases.items():
        model, _, _ = from_hf(root / "qwen2_policy", (2, 1))
        try:
            apply_lora(model, spec)
            results[f"refused/{label}"] = "accepted"
        except UserError as err:
            results[f"refused/{label}"] = str(err)
    model, _, _ = from_hf(root / "qwen3_moe_rm", (1, 1))
    try:
        apply_lora(model, LoRASpec(rank=2))
        results["refused/moe_experts"] = "accepted"
    except UserError as err:
        results["refused/moe_experts"] = str(err)


def main() -> None:
    root, out = Path(sys.argv[1]), Path(sys.argv[3])
    init_distributed()
    results: dict = {}
    for name in ("qwen2_policy", "llama_policy"):
        reference: dict = {}
        labels = LAYOUTS if name == "qwen2_policy" else ("tp1", "tp2")
        for label in labels:
            run_layout(root, name, label, results, reference)
    refusals(root, results)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=2))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
