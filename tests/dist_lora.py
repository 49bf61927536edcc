"""LoRA scenarios under torchrun (2 ranks), run once by tests/test_lora.py.

Every layout trains the same adapters on the same batch for a few steps (a layout with data
parallelism feeds each DP rank the same micro-batches, so DDP's mean is the single-rank
gradient); rank 0 writes a JSON of ``scenario -> number`` the pytest side asserts on, and the
trained policy's PEFT export plus its logits for the transformers/PEFT comparison.
Usage: torchrun --nproc-per-node 2 tests/dist_lora.py MODELS_ROOT WORKDIR SFT_WORKSPACE FAMILIES OUT.json
"""

from __future__ import annotations

import json
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rlhf.checkpoint.model_ckpt import (  # noqa: E402
    load_model_checkpoint, read_checkpoint_info, save_model_checkpoint)
from megatron_rlhf.config.schema import OptimConfig  # noqa: E402
from megatron_rlhf.convert.checkpoints import mcore_to_peft  # noqa: E402
from megatron_rlhf.convert.mapping import GLU_ROWS, ROWS, tp_shard  # noqa: E402
from megatron_rlhf.convert.peft import export_peft, gathered_adapters  # noqa: E402
from megatron_rlhf.convert.streaming_export import export_hf  # noqa: E402
from megatron_rlhf.distributed.launch import init_distributed  # noqa: E402
from megatron_rlhf.errors import UserError  # noqa: E402
from megatron_rlhf.models.forward import model_forward, token_cross_entropy  # noqa: E402
from megatron_rlhf.models.hf_config import padded_vocab_size  # noqa: E402
from megatron_rlhf.models.lora import (  # noqa: E402
    LoRASpec, adapters, adapters_disabled, apply_lora)
from megatron_rlhf.models.megatron_config import ModelOptions  # noqa: E402
from megatron_rlhf.trainers.engine import make_trainable, train_step  # noqa: E402
from tests.dist_lora_ppo import moe_ppo_with_lora, ppo_with_lora  # noqa: E402
from tests.dist_parity import (from_hf, layout_groups, logits_of, max_over_world,  # noqa: E402
                               write_results_and_leave)

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


def ddp_holds_adapters(trainable, model) -> float:
    """1.0 when megatron's DDP buffers (dense and expert) hold exactly the adapters."""
    ddp = trainable.model
    buffered = {id(p) for buf in ddp.buffers + ddp.expert_parallel_buffers for p in buf.params}
    return float(buffered == adapter_ids(model))


def unchanged_everywhere(model, frozen: dict) -> float:
    """1.0 when every frozen parameter (and buffer kept in ``frozen``) equals its copy there
    bitwise, on every rank."""
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    same = all(torch.equal(frozen[n], tensors[n]) for n in frozen)
    flag = torch.tensor([float(same)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return flag.item()


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
    results[f"{key}/ddp_params_are_adapters"] = ddp_holds_adapters(trainable, model)
    results[f"{key}/optimizer_numel_minus_expected"] = float(
        optimizer_numel(trainable, distopt) - expected_trainable(arch, tp, pp))
    for _ in range(STEPS):
        train_step(trainable, batches(), mean_loss(arch.vocab_size, groups))
    results[f"{key}/base_bitwise_unchanged"] = unchanged_everywhere(model, frozen)
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
        results[f"{key}/max_abs_grad"] = max(v.abs().max().item()
                                              for v in trained["grads"].values())


def export_trained(root: Path, name: str, model, groups, arch, padded, logits, tokens,
                   spec: LoRASpec = SPEC) -> None:
    out = Path(sys.argv[2]) / f"peft_{name}"  # WORKDIR
    export_peft(model, arch, groups, padded, spec, out, base_model=str(root / name))
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
    """``convert mcore-to-hf`` of the LoRA checkpoint: streamed with the adapters merged, and
    with ``--peft`` the adapters alone."""
    info = read_checkpoint_info(work / "ckpt_tp2")
    export_hf(info, work / "hf_merged", layout_groups((1, 1), info.arch.shape), 2**20)
    mcore_to_peft(info, work / "peft_from_checkpoint", layout_groups((1, 1), info.arch.shape))
    if dist.get_rank() == 0:
        torch.save({"tokens": tokens, "logits": logits}, work / "hf_merged_logits.pt")
    dist.barrier()


def trained_adapters(root: Path, layout, distopt: bool, steps: range, resume: Path | None = None,
                     save_at: int | None = None, out: Path | None = None) -> dict:
    """Adapters after ``steps`` (indexes into a 4-step schedule), saving a training checkpoint
    after step ``save_at`` into ``out``, or first resuming from ``resume``."""
    from transformers import AutoConfig, AutoTokenizer

    from megatron_rlhf.checkpoint.train_ckpt import CheckpointWriter, load_train_checkpoint

    model, groups, arch = from_hf(root / "qwen2_policy", layout)
    apply_lora(model, SPEC)
    trainable = make_trainable(model, groups, OPTIM, 4, distributed_optimizer=distopt)
    if resume is not None:
        load_train_checkpoint(resume, trainable)
    for step in steps:
        train_step(trainable, batches(), mean_loss(arch.vocab_size, groups))
        if step == save_at:
            writer = CheckpointWriter(out, trainable, {"kind": "policy", "family": arch.family,
                                                       "padded_vocab": 256, "lora": SPEC.as_dict()},
                                      AutoConfig.from_pretrained(root / "qwen2_policy"),
                                      AutoTokenizer.from_pretrained(root / "tokenizer"), 2)
            writer.save(step + 1, {"step": step + 1})
    return gathered_adapters(model, arch, groups, padded_vocab_size(arch.vocab_size, layout[0]))


def resume_exactly(root: Path, work: Path, results: dict) -> None:
    """Save after 2 of 4 steps, resume, finish: the adapters equal the uninterrupted run's.
    With the distributed optimizer too (megatron-core 0.16.1 cannot load its state into torch's
    Adam without the platform's fix: ``assert len(steps) == 1``, then ``KeyError: 'step'``)."""
    for label, layout, distopt in (("tp2", (2, 1), False), ("dp2", (1, 1), False),
                                   ("dp2_distopt", (1, 1), True)):
        out = work / f"train_{label}"
        straight = trained_adapters(root, layout, distopt, range(4), save_at=1, out=out)
        resumed = trained_adapters(root, layout, distopt, range(2, 4), resume=out / "step_00000002")
        results[f"resume/{label}"] = max((straight[k] - resumed[k]).abs().max().item()
                                         for k in straight)


def dropout_runs(root: Path, results: dict) -> None:
    """Adapter dropout under TP2 and TP2+SP: active in training (two passes differ), off in
    eval; the default RNG (replicated inputs' masks) stays in lockstep over the TP ranks."""
    from dataclasses import replace

    tokens = batches()[0]["input_ids"]
    for label, sp in (("tp2", False), ("tp2sp", True)):
        model, groups, arch = from_hf(root / "qwen2_policy", (2, 1),
                                      options=ModelOptions(sequence_parallel=sp))
        apply_lora(model, replace(SPEC, dropout=0.5))
        with torch.no_grad():
            for _, adapter in adapters(model):  # a non-zero B, so dropout shows in the output
                adapter.lora_b.copy_(torch.randn(adapter.lora_b.shape,
                                                 generator=torch.Generator().manual_seed(5)))
        model.train()
        first = model_forward(model, {"input_ids": tokens})
        first.float().pow(2).mean().backward()  # the backward through the masks runs
        with torch.no_grad():
            second = model_forward(model, {"input_ids": tokens})
        evaluated = logits_of(model, groups, tokens, arch.vocab_size)  # eval mode
        again = logits_of(model, groups, tokens, arch.vocab_size)
        with adapters_disabled(model):
            base = logits_of(model, groups, tokens, arch.vocab_size)
        state = torch.random.get_rng_state()
        states = [torch.zeros_like(state) for _ in range(2)]
        dist.all_gather(states, state)
        results[f"dropout/{label}/train_passes_differ"] = (first - second).abs().max().item()
        results[f"dropout/{label}/eval_repeats"] = (evaluated - again).abs().max().item()
        results[f"dropout/{label}/eval_vs_base"] = (evaluated - base).abs().max().item()
        results[f"dropout/{label}/a_grads_finite"] = float(all(
            torch.isfinite(a.lora_a.grad).all().item() for _, a in adapters(model)))
        results[f"dropout/{label}/rng_lockstep"] = float(torch.equal(states[0], states[1]))


def value_model_head_trains(root: Path, results: dict) -> None:
    """On a reward/value model the scalar head trains beside the adapters."""
    model, _, _ = from_hf(root / "qwen2_rm", (2, 1))
    apply_lora(model, SPEC)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    expected = {f"{name}.adapter.lora_{x}" for name, _ in adapters(model) for x in "ab"}
    results["value/trainable_are_adapters_and_head"] = float(
        trained == expected | {"output_layer.weight"})


def sft_with_lora(workspace: Path, work: Path, results: dict) -> None:
    """`megatron-rlhf sft` with model.lora at TP2, in this world: it learns, and its checkpoint
    carries the adapters."""
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.schema import SFTConfig
    from megatron_rlhf.trainers.sft import train_sft
    from tests.dist_parity import release_groups

    release_groups()
    out = work / "sft_lora"
    config = load_config(SFTConfig, str(Path(__file__).parents[1] / "configs/sft/tiny_cpu.yaml"), [
        f"model.path={workspace / 'base'}",
        f"data.train_files=[{workspace / 'data/sft_train.parquet'}]",
        "data.val_files=[]", f"trainer.output_dir={out}", "data.train_batch_size=16",
        "data.micro_batch_size_per_rank=8", "trainer.max_steps=6", "trainer.logger=console",
        "trainer.log_every_steps=1", "optim.lr=1e-2", "model.lora.rank=8", "parallel.tp=2"])
    train_sft(config)
    if dist.get_rank() == 0:
        losses = [json.loads(line)["train/loss"]
                  for line in (out / "metrics.jsonl").read_text().splitlines()]
        results["sft/first_loss"], results["sft/last_loss"] = losses[0], losses[-1]
        results["sft/checkpoint_lora_rank"] = float(
            read_checkpoint_info(out / "checkpoints/step_00000006").lora.rank)


def refusals(root: Path, families: Path, results: dict) -> None:
    """Each bad setting raises one UserError naming the problem (on every rank)."""
    cases = {"rank_wider_than_layer": LoRASpec(rank=65),
             "mla_target": LoRASpec(rank=2, target_modules=("linear_kv_up_proj",)),  # dense model
             "unknown_target": LoRASpec(rank=2, target_modules=("q_proj",))}
    for label, spec in cases.items():
        model, _, _ = from_hf(root / "qwen2_policy", (2, 1))
        try:
            apply_lora(model, spec)
            results[f"refused/{label}"] = "accepted"
        except UserError as err:
            results[f"refused/{label}"] = str(err)
    model, _, _ = from_hf(root / "qwen2_policy", (1, 1))
    apply_lora(model, SPEC)
    try:
        apply_lora(model, SPEC)
        results["refused/twice"] = "accepted"
    except UserError as err:
        results["refused/twice"] = str(err)
    model, _, _ = from_hf(families / "deepseek_v3", (1, 1))
    try:
        apply_lora(model, LoRASpec(rank=2))  # the dense default targets: no linear_qkv
        results["refused/mla_model_default_targets"] = "accepted"
    except UserError as err:
        results["refused/mla_model_default_targets"] = str(err)
    model, _, _ = from_hf(families / "qwen3_moe", (2, 1, None, 1, 2),
                          options=ModelOptions(sequence_parallel=True))
    try:
        apply_lora(model, LoRASpec(rank=2))
        results["refused/experts_etp2"] = "accepted"
    except UserError as err:
        results["refused/experts_etp2"] = str(err)


# MoE: adapters on attention, dense MLPs, shared and routed experts; (tp, pp, dp, ep), 2 ranks.
MOE_SPEC = {"qwen3_moe": SPEC,
            # Every linear of multi-latent attention, of the dense, shared and routed MLPs.
            "deepseek_v3": LoRASpec(rank=4, alpha=8.0, seed=3, target_modules=(
                "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                "linear_kv_up_proj", "linear_proj", "linear_fc1", "linear_fc2"))}
MOE_LAYOUTS = {"ep1": (1, 1), "ep2": (1, 1, None, 2), "tp2sp_ep2": (2, 1, None, 2), "pp2": (1, 2)}
# DeepSeek-V3 at TP2 + SP x EP2 trains equal to EP1 only with the platform's fix of MLA's
# rotary key gradient (megatron-core's local spec drops other ranks' share: 1% off after a step).
# TP2 + SP with EP1 (every expert whole on both TP ranks) needs the builder's tagging of the
# experts' gradients as summed over TP (megatron-core treats experts at EP1 as dense).
MOE_LAYOUTS["tp2sp"] = (2, 1)
MOE_EXPORT = "tp2sp_ep2"  # the layout whose adapters go to PEFT
MOE_RUNS = {"qwen3_moe": list(MOE_LAYOUTS), "deepseek_v3": list(MOE_LAYOUTS),
            "deepseek_v3_no_q_lora": ["ep1", "tp2sp"]}
# Forward only (the adapted model at step 0, B random): MLA without q_lora_rank cut over TP2+SP.
FORWARD_ONLY = {("deepseek_v3_no_q_lora", "ep1"), ("deepseek_v3_no_q_lora", "tp2sp")}
MOE_SPEC["deepseek_v3_no_q_lora"] = LoRASpec(rank=4, alpha=8.0, seed=3, target_modules=(
    "linear_q_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"))


def full_adapters(model, groups, field: str = "data") -> dict[str, torch.Tensor]:
    """Every adapter's full A and B (gathered over its TP group) by its layout-free key, from
    every rank (routed experts from the rank that holds them)."""
    mine = {}
    for _, adapter in adapters(model):
        for name, dim in (("lora_a", None if adapter.column else 1), ("lora_b", 0 if adapter.column else None)):
            value = getattr(getattr(adapter, name), field).detach()
            group = adapter.tp_group
            if dim is not None and group.size() > 1:
                pieces = [torch.empty_like(value) for _ in range(group.size())]
                dist.all_gather(pieces, value.contiguous(), group=group)
                value = torch.cat(pieces, dim=dim) if not adapter.glu or dim != 0 else torch.cat(
                    [p.chunk(2)[0] for p in pieces] + [p.chunk(2)[1] for p in pieces])
            mine[f"{adapter.key}.lora_{name[-1].upper()}"] = value.float().clone()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {k: v for part in everyone for k, v in part.items()}


def random_b(adapter) -> None:
    """A full B drawn from the adapter's layout-free key, this rank's rows of it (a column
    adapter's B is cut over TP as its base's rows): every layout gets the same adapter."""
    rows = adapter.lora_b.shape[0] * (adapter.tp_group.size() if adapter.column else 1)
    generator = torch.Generator().manual_seed(zlib.crc32(adapter.key.encode()))
    full = torch.empty(rows, adapter.lora_b.shape[1]).normal_(0, 0.02, generator=generator)
    if adapter.column:
        full = tp_shard(full, GLU_ROWS if adapter.glu else ROWS, adapter.tp_group.rank(),
                        adapter.tp_group.size())
    adapter.lora_b.data.copy_(full)


def moe_layouts(families: Path, results: dict) -> None:
    """Tiny Qwen3-MoE and DeepSeek-V3 with adapters on their experts: three Adam steps at EP2,
    TP2+SP x EP2 and PP2 equal EP1 (logits, adapter weights and gradients), only adapters train."""
    tokens = batches()[0]["input_ids"]
    for name, spec in MOE_SPEC.items():
        reference: dict = {}
        first: dict = {}  # the EP1 run's step-0 logits
        for label in MOE_RUNS[name]:
            layout = MOE_LAYOUTS[label]
            sp = layout[0] > 1
            model, groups, arch = from_hf(families / name, layout,
                                          options=ModelOptions(sequence_parallel=sp))
            base = logits_of(model, groups, tokens, arch.vocab_size)
            adapted = apply_lora(model, spec)
            key = f"moe/{name}/{label}"
            results[f"{key}/expert_adapters"] = float(max_over_world(
                sum(".local_experts." in n for n in adapted)))
            frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
            frozen.update({n: b.detach().clone() for n, b in model.named_buffers()  # the routers'
                           if n.endswith("expert_bias")})
            for _, adapter in adapters(model):  # B != 0, so every adapter acts from step 0
                random_b(adapter)
            step0 = logits_of(model, groups, tokens, arch.vocab_size)
            results[f"{key}/adapters_change_the_model"] = max_over_world(
                None if base is None else (step0 - base).abs().max().item())
            first.setdefault("logits", step0)
            results[f"{key}/step0_vs_ep1"] = max_over_world(
                None if step0 is None or first["logits"] is None
                else (step0 - first["logits"]).abs().max().item())
            if (name, label) in FORWARD_ONLY:
                continue
            trainable = make_trainable(model, groups, OPTIM, STEPS)
            results[f"{key}/ddp_params_are_adapters"] = ddp_holds_adapters(trainable, model)
            for _ in range(STEPS):
                train_step(trainable, batches(), mean_loss(arch.vocab_size, groups))
            results[f"{key}/base_bitwise_unchanged"] = unchanged_everywhere(model, frozen)
            trained = {"logits": logits_of(model, groups, tokens, arch.vocab_size),
                       "weights": full_adapters(model, groups),
                       "grads": full_adapters(model, groups, "main_grad")}
            compare(key, trained, reference, results)
            if label == MOE_EXPORT:  # routed experts' adapters from their EP ranks, TP gathered
                export_trained(families, name, model, groups, arch,
                               padded_vocab_size(arch.vocab_size, layout[0]), trained["logits"],
                               tokens, spec)


def main() -> None:
    root, work, sft, families, out = (Path(arg) for arg in sys.argv[1:6])
    init_distributed()
    results: dict = {}

    def layouts():
        for name in ("qwen2_policy", "llama_policy"):
            reference: dict = {}
            for label in LAYOUTS if name == "qwen2_policy" else ("tp1", "tp2"):
                run_layout(root, name, label, results, reference)

    sections = {"layouts": layouts, "resume": lambda: resume_exactly(root, work, results),
                "value": lambda: value_model_head_trains(root, results),
                "dropout": lambda: dropout_runs(root, results),
                "sft": lambda: sft_with_lora(sft, work, results),
                "ppo": lambda: ppo_with_lora(sft, work, results),
                "ppo_moe": lambda: moe_ppo_with_lora(sft, families, results),
                "refusals": lambda: refusals(root, families, results),
                "moe": lambda: moe_layouts(families, results)}
    for section, run in sections.items():
        started = time.perf_counter()
        run()
        results[f"seconds/{section}"] = round(time.perf_counter() - started, 1)
    write_results_and_leave(out, results)


if __name__ == "__main__":
    main()
