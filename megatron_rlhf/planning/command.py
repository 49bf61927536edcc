"""The ``plan`` command: arguments -> :mod:`~megatron_rlhf.planning.plan` -> a table or JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_rlhf.errors import UserError
from megatron_rlhf.planning.plan import GIB, Hardware, Rollout, Run, candidate_layouts, evaluate, rank
from megatron_rlhf.planning.params import active_params, model_params

TERMS = ("weights", "gradients", "optimizer", "activations", "logits", "critic", "reference",
         "reward_model", "rollout_engine")


def add_arguments(plan: argparse.ArgumentParser) -> None:
    plan.add_argument("--model", required=True, help="HF folder with config.json (no weights needed)")
    plan.add_argument("--gpus", type=int, required=True, help="GPUs of the job, all nodes")
    plan.add_argument("--gpus-per-node", type=int, default=8)
    plan.add_argument("--gpu-mem-gib", type=float, default=80.0)
    plan.add_argument("--config", help="a train-rm, sft or ppo YAML: evaluate its layout and batch")
    plan.add_argument("--seq-len", type=int, default=4096, help="tokens per row (without --config)")
    plan.add_argument("--micro-batch", type=int, default=1, help="rows per micro-batch per rank")
    plan.add_argument("--global-batch", type=int, default=256, help="rows per optimizer step")
    plan.add_argument("--recompute", choices=("none", "selective", "full"), default="selective")
    plan.add_argument("--optimizer-offload", action="store_true",
                      help="megatron-core's optimizer CPU offload (the optimizer step on the "
                           "host; not a trainer option here: it needs CUDA parameters)")
    plan.add_argument("--offload-during-rollout", action="store_true",
                      help="trainer state in host memory while the engine runs (a ppo config's "
                           "actor.offload.params, which --config reads; this flag plans it "
                           "without a config)")
    plan.add_argument("--kernels", choices=("te", "local"), default="te",
                      help="te: Transformer Engine + flash attention, what a GPU cluster's image "
                           "runs (its activation formula is not measured here: the plan says "
                           "so); local: megatron's local spec, as on CPU (measured)")
    plan.add_argument("--lora-rank", type=int, default=0,
                      help="without --config: LoRA adapters of this rank on every linear the "
                           "model has (experts and multi-latent attention included); a --config "
                           "says its own (model.lora, actor.lora, critic.lora)")
    plan.add_argument("--top", type=int, default=10, help="layouts shown without --config")
    plan.add_argument("--json", action="store_true")
    plan.add_argument("--check", action="store_true",
                      help="exit 1 when nothing fits (or the --config layout does not)")


def _job_of(raw: dict) -> str:
    if "actor" in raw or "agents" in raw:
        return "ppo"
    return "train-rm" if "loss" in raw else "sft"


def _from_config(path: str, args):
    """(layout, run) of a trainer YAML, validated like the trainers validate it."""
    import yaml

    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.parallel import layout_of
    from megatron_rlhf.config.ppo_checks import builds_reference_model, uses_critic

    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise UserError(f"plan: cannot read {path}: {err}") from err
    job = _job_of(raw)
    if job == "ppo":
        from megatron_rlhf.config.ppo_schema import PPOConfig

        c = load_config(PPOConfig, path, [])
        a, r = c.actor, c.rollout
        rows = c.data.train_batch_size * r.n
        run = Run(job, seq=c.data.max_prompt_length + c.data.max_response_length,
                  micro_batch=a.ppo_micro_batch_size_per_rank,
                  global_batch=a.ppo_mini_batch_size,
                  recompute=a.parallel.recompute_granularity or "none",
                  distributed_optimizer=a.parallel.use_distributed_optimizer,
                  param_bytes=4 if a.dtype == "float32" else 2,
                  critic=uses_critic(c),
                  reference=builds_reference_model(c),
                  reward_model=bool(c.reward.model_path),
                  offload_during_rollout=a.offload.params,
                  lora_rank=a.lora.rank, lora_targets=tuple(a.lora.target_modules),
                  critic_lora_rank=c.critic.lora.rank,
                  critic_lora_targets=tuple(c.critic.lora.target_modules),
                  packing=_packing(c.data),
                  rollout=Rollout(r.backend, r.tp, r.gpu_memory_utilization,
                                  max(rows * r.tp // args.gpus, 1),
                                  c.data.max_prompt_length + c.data.max_response_length,
                                  None if r.dtype == "auto" else 4 if r.dtype == "float32" else 2,
                                  c.data.max_prompt_length, r.n))
        return layout_of(a.parallel), run
    from megatron_rlhf.config.schema import RMConfig, SFTConfig

    c = load_config(RMConfig if job == "train-rm" else SFTConfig, path, [])
    pairs = 2 if job == "train-rm" else 1  # a preference pair is two sequences
    run = Run(job, seq=c.data.max_prompt_length + c.data.max_response_length,
              micro_batch=c.data.micro_batch_size_per_rank * pairs,
              global_batch=c.data.train_batch_size * pairs,
              recompute=c.parallel.recompute_granularity or "none",
              distributed_optimizer=c.parallel.use_distributed_optimizer,
              param_bytes=4 if c.model.dtype == "float32" else 2,
              lora_rank=c.model.lora.rank, lora_targets=tuple(c.model.lora.target_modules),
              packing=_packing(c.data))
    return layout_of(c.parallel), run


def _packing(data) -> str:
    """How a config's rows are laid out (:class:`Run`): its sharing resolved as the trainer
    resolves it, refusals included (SFT has no groups to share)."""
    from megatron_rlhf.config.schema import prompt_sharing

    packed = bool(data.use_remove_padding)
    shared = prompt_sharing(getattr(data, "share_prompts", False), packed)
    return "shared" if shared else "packed" if packed else "none"


def _table(plans, hw: Hardware) -> str:
    shown = [t for t in TERMS if any(p.terms.get(t) for p in plans)]
    head = ["layout", *shown, "total", "fits"]
    rows = [head]
    for p in plans:
        lay = p.layout
        name = f"tp{lay.tp} pp{lay.pp} dp{lay.dp}" + (f" ep{lay.ep}" if lay.ep > 1 else "")
        if len(set(p.stages)) > 1:
            name += f" [{p.stages[0]}/../{p.stages[-1]}]"
        rows.append([name, *(f"{p.terms.get(t, 0) / GIB:.1f}" for t in shown),
                     f"{p.total / GIB:.1f}", "yes" if p.fits else "NO"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, f"(GiB per GPU, {hw.gpu_mem_gib:g} GiB each)")
    return "\n".join(lines)


def _why_not(best, hw: Hardware) -> str:
    """The term that takes the closest layout past the GPU, counting in TERMS order (state
    first): for a model too large for the GPUs, its weights."""
    limit, running, names = hw.gpu_mem_gib * GIB, 0.0, []
    state = [t for t in TERMS if t not in ("activations", "logits", "rollout_engine")]
    working = best.terms.get("activations", 0) + best.terms.get("logits", 0)
    phase = ["rollout_engine"] if best.terms.get("rollout_engine", 0) > working else \
        ["activations", "logits"]
    for term in state + phase:
        if best.terms.get(term):
            running += best.terms[term]
            names.append(term)
            if running > limit:
                break
    what = f"{names[0]} alone need" if len(names) == 1 else " + ".join(names) + " need"
    return (f"nothing fits {hw.gpu_mem_gib:g} GiB GPUs; the closest layout ({best.layout}) "
            f"needs {best.total / GIB:.1f} GiB per GPU, {what} {running / GIB:.1f} GiB")


def _unmeasured(run) -> list[str]:
    """Terms of the plan whose formula no measurement here has checked (docs/planner.md)."""
    return ["activations"] if run.te_layers else []


def run_plan(args) -> int:
    from megatron_rlhf.convert.checkpoints import read_hf_arch

    if args.gpus < 1 or args.gpus_per_node < 1 or args.gpu_mem_gib <= 0:
        raise UserError("plan: --gpus, --gpus-per-node and --gpu-mem-gib must be positive")
    if not (Path(args.model) / "config.json").is_file():
        raise UserError(f"plan: {args.model} has no config.json")
    arch = read_hf_arch(args.model)
    hw = Hardware(args.gpus, args.gpus_per_node, args.gpu_mem_gib)
    extra = dict(optimizer_offload=args.optimizer_offload, kernels=args.kernels,
                 offload_during_rollout=args.offload_during_rollout)
    if args.config:
        layout, run = _from_config(args.config, args)
        from dataclasses import replace

        if run.job == "ppo":  # the config says whether the trainer steps aside
            if args.offload_during_rollout and not run.offload_during_rollout:
                raise UserError(f"plan: --offload-during-rollout, but {args.config} does not "
                                "offload during rollout: set actor.offload.params: true there")
            extra["offload_during_rollout"] = run.offload_during_rollout
        run = replace(run, **extra)
        layout = layout.resolve(args.gpus, arch.shape)
        if run.global_batch % (layout.dp * run.micro_batch):
            raise UserError(f"plan: {run.global_batch} rows per step do not split into "
                            f"micro-batches of {run.micro_batch} over dp={layout.dp}")
        plans = rank([evaluate(arch, layout, hw, run)], hw, run)
    else:
        from megatron_rlhf.models.lora import DENSE_TARGETS, MLA_TARGETS

        if args.lora_rank < 0:
            raise UserError(f"plan: --lora-rank={args.lora_rank} must be >= 0")
        every = (MLA_TARGETS + DENSE_TARGETS[1:]) if arch.mla is not None else DENSE_TARGETS
        run = Run(seq=args.seq_len, micro_batch=args.micro_batch, global_batch=args.global_batch,
                  recompute=args.recompute, lora_rank=args.lora_rank,
                  lora_targets=every if args.lora_rank else (), **extra)
        layouts = candidate_layouts(arch, hw)
        if not layouts:
            raise UserError(f"plan: no layout of {arch.family} divides {args.gpus} GPUs")
        plans = rank([evaluate(arch, lay, hw, run) for lay in layouts], hw, run)
    fits = any(p.fits for p in plans)
    if args.json:
        print(json.dumps({"model": args.model, "family": arch.family,
                          "params_total": model_params(arch), "params_active": active_params(arch),
                          "gpus": hw.gpus, "gpu_mem_gib": hw.gpu_mem_gib, "job": run.job,
                          "kernels": run.kernels, "unmeasured": _unmeasured(run),
                          "layouts": [p.as_json() for p in plans]}, indent=1))
    else:
        lora = (f", LoRA rank {run.lora_rank} on {', '.join(run.lora_targets)} (megatron's local "
                "layers)" if run.lora_rank else "")
        print(f"{arch.family}: {model_params(arch) / 1e9:.2f}B parameters, "
              f"{active_params(arch) / 1e9:.2f}B active per token; {run.job} on {hw.gpus} GPUs "
              f"({hw.gpus_per_node} per node){lora}")
        print("activations: Korthikanti et al. 2022's formula for Transformer Engine "
              "(--kernels te), not measured by this project; --kernels local (megatron's local "
              "spec) is measured, within 15% of the tensors autograd saves"
              if _unmeasured(run) else "activations: megatron's local spec (--kernels local, or "
              "LoRA's adapted layers), measured: within 15% of the tensors autograd saves")
        shown = plans if args.config else plans[:args.top]
        print(_table(shown, hw))
        for i, p in enumerate(shown, 1):
            print(f"{i}. {p.layout}: {p.why}" + "".join(f"\n   {n}" for n in p.notes))
    if args.check and not fits:
        best = min(plans, key=lambda p: p.total)
        print(f"error: plan: {_why_not(best, hw)}", file=sys.stderr, flush=True)
        return 1
    return 0
