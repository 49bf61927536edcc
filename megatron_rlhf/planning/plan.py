"""``megatron-rlhf plan``: per-GPU memory of every layout of a model on N GPUs, before booking them.

A layout's memory is that of its heaviest pipeline stage. A rank keeps its models' state
(:mod:`~megatron_rlhf.planning.memory`) the whole run; on top of it either the training working
set (activations of the micro-batches the 1F1B schedule has in flight on that stage, the
largest layer rebuilt under full recompute, the logits on the last stage) or, for PPO with a
colocated engine, the rollout engine (its static memory fraction for SGLang; weights and the
batch's KV cache for the ``hf`` engine), whichever is larger. docs/planner.md gives every formula
and where it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

from megatron_rlhf.distributed.layout import ParallelLayout
from megatron_rlhf.errors import UserError
from megatron_rlhf.models.hf_config import ModelArch, padded_vocab_size
from megatron_rlhf.planning.activations import (Workload, decoder_saved_bytes, kv_bytes_per_token,
                                                logits_bytes, recompute_working_bytes)
from megatron_rlhf.planning.memory import offloaded, train_state_bytes
from megatron_rlhf.planning.params import RankParams, model_params, rank_tensors, with_lora

GIB = 2 ** 30


@dataclass(frozen=True)
class Hardware:
    gpus: int
    gpus_per_node: int = 8
    gpu_mem_gib: float = 80.0


# data/packing.py's SHARED_ROW_FACTOR (planning may not import data: docs/architecture.md);
# tests/test_plan.py holds the two equal.
SHARED_ROW_FACTOR = 4


@dataclass(frozen=True)
class Rollout:
    """A colocated rollout engine on the trainer's GPUs."""

    backend: str = "sglang"
    tp: int = 1  # GPUs per engine
    memory_fraction: float = 0.4  # SGLang's static pool (weights + KV) per GPU
    rows: int = 1  # sequences one engine holds at once (hf engine: its whole share)
    seq: int = 1  # prompt + response tokens
    param_bytes: int | None = None  # rollout.dtype's width; None: the trainer's
    prompt: int = 0  # prompt tokens of ``seq``, shared by ``n`` samples in SGLang's radix cache
    n: int = 1  # samples per prompt (rollout.n)


@dataclass(frozen=True)
class Run:
    """What a layout is evaluated for. Batch units: ``micro_batch`` rows (sequences) per
    micro-batch per data-parallel rank, ``global_batch`` rows per optimizer step, all ranks."""

    job: str = "sft"  # sft | train-rm | ppo
    seq: int = 4096
    micro_batch: int = 1
    global_batch: int = 256
    recompute: str = "none"  # none | selective | full
    distributed_optimizer: bool = True
    optimizer_offload: bool = False
    param_bytes: int = 2  # bf16
    kernels: str = "te"
    critic: bool = False
    reference: bool = False
    reward_model: bool = False
    rollout: Rollout | None = None
    offload_during_rollout: bool = False
    # LoRA (0: full training): the trained model's and the critic's adapters (megatron's local
    # layers: adapters need them, so the planner counts those, whatever ``kernels`` says).
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    critic_lora_rank: int = 0
    critic_lora_targets: tuple[str, ...] = ()
    # Rows: padded (none), packed (data.use_remove_padding: a dense mask on the local spec) or
    # packed with shared prompts (RoPE per token; a group's row up to SHARED_ROW_FACTOR x seq).
    packing: str = "none"

    @property
    def te_layers(self) -> bool:
        """Planned on Transformer Engine's layers (``--kernels te`` and no adapters): their
        activation formula is the one no measurement here has checked."""
        return self.kernels == "te" and not (self.lora_rank or self.critic_lora_rank)


@dataclass
class LayoutPlan:
    layout: ParallelLayout
    stages: list[int]
    max_rank_params: int
    terms: dict[str, float]
    total: float
    fits: bool
    largest: str
    notes: list[str] = field(default_factory=list)
    why: str = ""
    # The heaviest stage's state with and without the distributed optimizer and with
    # megatron-core's optimizer CPU offload (host bytes under "optimizer_host").
    state_variants: dict = field(default_factory=dict)

    def as_json(self) -> dict:
        lay = self.layout
        return {"tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "etp": lay.etp, "dp": lay.dp,
                "stages": self.stages, "max_rank_params": self.max_rank_params,
                "bytes_per_gpu": {k: int(v) for k, v in self.terms.items()},
                "total_bytes_per_gpu": int(self.total), "fits": self.fits,
                "largest_term": self.largest, "why": self.why, "notes": self.notes,
                "state_bytes_by_optimizer": self.state_variants}


def _workload(run: Run, layout: ParallelLayout) -> Workload:
    """One micro-batch as the model sees it. Packed rows carry a dense mask only on megatron's
    local spec (Transformer Engine packs without one). Shared prompts keep the tokens but may
    widen a row to a whole group, up to SHARED_ROW_FACTOR rows' worth: planned at the widest,
    which is the largest mask for those tokens."""
    batch, seq = run.micro_batch, run.seq
    packed = run.packing != "none" and not run.te_layers
    shared = packed and run.packing == "shared"
    if shared:
        factor = min(batch, SHARED_ROW_FACTOR)
        batch, seq = -(-batch // factor), seq * factor
    return Workload(batch, seq, run.param_bytes, layout.tp, layout.tp > 1, packed=packed,
                    positions=shared)


# A pure function of frozen inputs, and the costliest part of a plan (every tensor of a stage:
# ~0.2 s a layout of DeepSeek-V3): a process that plans the same model again (the A/B of a
# setting, the tests) reuses it. Callers copy what they change.
@lru_cache(maxsize=1024)
def _stage_terms(arch: ModelArch, layout: ParallelLayout, stage: int,
                 run: Run) -> tuple[dict[str, float], int]:
    padded = padded_vocab_size(arch.vocab_size, layout.tp)
    expert_dp = layout.tp * layout.dp // (layout.ep * layout.etp)
    # Transformer Engine's specs replicate MLA's down projections; LoRA runs on the local spec.
    te = run.te_layers
    base = rank_tensors(arch, layout, stage, te, padded)
    tensors = with_lora(base, run.lora_rank, run.lora_targets, arch.kind == "value") \
        if run.lora_rank else base
    on_gpu = {}  # distributed optimizer or not -> the state; CPU offload only moves its optimizer

    def state_of(distributed: bool, offload: bool):
        if distributed not in on_gpu:
            on_gpu[distributed] = train_state_bytes(tensors, layout.dp, expert_dp,
                                                    run.param_bytes, distributed)
        return offloaded(on_gpu[distributed]) if offload else on_gpu[distributed]

    state = state_of(run.distributed_optimizer, run.optimizer_offload)
    variants = {name: state_of(dist_opt, offload)
                for name, dist_opt, offload in (("replicated", False, False),
                                                ("distributed", True, False),
                                                ("distributed_cpu_offload", True, True))}
    first, count = layout.stage_of(arch.num_layers, stage)
    layers, last = range(first, first + count), stage == layout.pp - 1
    w = _workload(run, layout)
    micro_batches = max(run.global_batch // (layout.dp * run.micro_batch), 1)
    in_flight = min(layout.pp - stage, micro_batches)
    saved = decoder_saved_bytes(arch, w, run.recompute, layers, run.kernels, final_norm=last)
    terms = {"weights": state.weights, "gradients": state.gradients, "optimizer": state.optimizer,
             "activations": saved * in_flight + recompute_working_bytes(
                 arch, w, run.recompute, layers, run.kernels),
             "logits": logits_bytes(arch, w, padded) if last else 0.0}
    terms["_variants"] = {name: {"weights": s.weights, "gradients": s.gradients,
                                 "optimizer": s.optimizer, "optimizer_host": s.optimizer_offloaded}
                          for name, s in variants.items()}
    value = replace(arch, kind="value")
    values = rank_tensors(value, layout, stage, te, padded) if run.critic or run.reward_model else []
    if run.critic:
        trained = with_lora(values, run.critic_lora_rank, run.critic_lora_targets, True) \
            if run.critic_lora_rank else values
        critic = train_state_bytes(trained, layout.dp, expert_dp, run.param_bytes,
                                   run.distributed_optimizer, run.optimizer_offload)
        terms["critic"] = critic.weights + critic.gradients + critic.optimizer
    if run.reference:
        terms["reference"] = sum(t.numel for t in base) * run.param_bytes
    if run.reward_model:
        terms["reward_model"] = sum(t.numel for t in values) * run.param_bytes
    params = RankParams.of(tensors).total
    return terms, params


def _engine_bytes(arch: ModelArch, run: Run, hw: Hardware) -> tuple[float, list[str], bool]:
    """(bytes per GPU, notes, whether the engine's weights fit its SGLang pool)."""
    r = run.rollout
    width = r.param_bytes or run.param_bytes
    weights = model_params(arch) * width / r.tp
    kv = kv_bytes_per_token(arch, width, r.tp)
    if r.backend == "sglang":
        pool = r.memory_fraction * hw.gpu_mem_gib * GIB
        room = pool - weights
        if room <= 0:
            return pool, [f"rollout engine: weights ({weights / GIB:.1f} GiB per GPU at "
                          f"rollout.tp={r.tp}) exceed gpu_memory_utilization={r.memory_fraction}"
                          f" of the GPU"], False
        tokens = room / kv
        # SGLang's radix cache holds a prompt once for its n samples: a sample costs its reply
        # and 1/n of its prompt (the hf engine prefills a prompt once, then copies its cache)
        shared = r.seq - r.prompt + r.prompt / r.n if r.n > 1 and r.prompt else r.seq
        sequences = f"{tokens / max(r.seq, 1):,.0f} sequences of {r.seq}"
        if shared < r.seq:
            sequences += (f"; {tokens / shared:,.0f} with each prompt of {r.prompt} held once "
                          f"for its {r.n} samples")
        notes = [f"rollout engine: {weights / GIB:.1f} GiB of weights per GPU (rollout.tp={r.tp}),"
                 f" KV cache for {tokens:,.0f} tokens per engine ({sequences}, "
                 f"{kv / 1024:.1f} KiB per token per GPU)"]
        return pool, notes, True
    return weights + kv * r.rows * r.seq, [], True


def evaluate(arch: ModelArch, layout: ParallelLayout, hw: Hardware, run: Run) -> LayoutPlan:
    """Per-GPU bytes of ``layout`` (resolved: dp known) for ``run``: its heaviest stage."""
    stages = layout.stage_layers(arch.num_layers)
    candidates = sorted({0, min(1, layout.pp - 1), layout.pp - 1})  # middle stages are alike
    engine, notes, engine_fits = (_engine_bytes(arch, run, hw) if run.rollout else (0.0, [], True))
    best, max_params = None, 0
    for stage in candidates:
        terms, params = _stage_terms(arch, layout, stage, run)
        terms = dict(terms)  # cached: left as it was
        max_params = max(max_params, params)
        variants = terms.pop("_variants")
        resident = sum(v for k, v in terms.items() if k not in ("activations", "logits"))
        training = resident + terms["activations"] + terms["logits"]
        rollout = engine + (0 if run.offload_during_rollout else resident)
        if run.rollout:
            terms["rollout_engine"] = engine
        total = max(training, rollout)
        if best is None or total > best[0]:
            best = (total, terms, variants)
    total, terms, variants = best
    limit = hw.gpu_mem_gib * GIB
    largest = max(terms, key=terms.get)
    # An engine whose weights overflow its pool does not start, whatever the total says.
    return LayoutPlan(layout, stages, max_params, terms, total, total <= limit and engine_fits,
                      "rollout_engine" if not engine_fits else largest, notes,
                      state_variants=variants)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(arch: ModelArch, hw: Hardware) -> list[ParallelLayout]:
    """Every layout the layout rules accept: TP within a node, PP with megatron-core's uneven
    split where it does not divide the layers, EP over a stage's ranks, ETP 1."""
    found = []
    experts = arch.moe.num_experts if arch.moe else 0
    for tp in _divisors(min(hw.gpus_per_node, hw.gpus)):
        if hw.gpus % tp:
            continue
        for pp in _divisors(hw.gpus // tp):
            if pp > arch.num_layers:
                continue
            for ep in (_divisors(experts) if experts else [1]):
                try:
                    found.append(ParallelLayout(tp=tp, pp=pp, ep=ep).resolve(hw.gpus, arch.shape))
                except UserError:
                    continue
    return found


def rank(plans: list[LayoutPlan], hw: Hardware, run: Run) -> list[LayoutPlan]:
    """Fitting layouts first; among them the smallest pipeline bubble, then the least
    tensor-parallel traffic, then the most memory to spare."""
    micro = lambda p: max(run.global_batch // (p.layout.dp * run.micro_batch), 1)  # noqa: E731
    bubble = lambda p: (p.layout.pp - 1) / (micro(p) + p.layout.pp - 1)  # noqa: E731
    plans = sorted(plans, key=lambda p: (not p.fits, round(bubble(p), 3), p.layout.tp,
                                         p.layout.ep, p.total))
    limit = hw.gpu_mem_gib * GIB
    for p in plans:
        spare = (limit - p.total) / GIB
        if p.fits:
            head = f"fits with {spare:.1f} GiB to spare"
        elif spare >= 0:  # within the GPU, but the engine's weights overflow its pool
            head = "the rollout engine's weights do not fit its memory pool (see below)"
        else:
            head = f"over by {-spare:.1f} GiB, largest term {p.largest}"
        p.why = (f"{head}; pipeline bubble {bubble(p):.0%} ({micro(p)} micro-batches over "
                 f"pp={p.layout.pp}); tp={p.layout.tp}"
                 + (f", ep={p.layout.ep}" if p.layout.ep > 1 else ""))
    return plans
