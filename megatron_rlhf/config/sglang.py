"""What the ``sglang`` rollout backend hands SGLang, derived from the config in one place: the
engine (server) arguments of a ``rollout`` section and the sampling parameters of each sample.

Names are checked at start-up against the installed SGLang's own when it imports, else against
:mod:`.sglang_names` (read from the pinned SGLang's wheel by ``tools/gpu_pins.py``), so that a
setting SGLang does not know is one line on any machine, not an error inside an engine start on
the GPUs.
"""

from __future__ import annotations

from types import SimpleNamespace

from megatron_rlhf.errors import UserError

# Per-sample seeds: a generator replica's base seed times this, plus the sample's index in the
# call. Larger than any call's sample count, so replicas (whose base seeds differ by their rank)
# never share a seed.
SEED_STRIDE = 2 ** 20
# Arguments the backend sets itself; rollout.engine_args may not override them.
OURS = ("model_path", "tp_size", "ep_size", "dtype", "load_format", "enable_memory_saver",
        "mem_fraction_static", "base_gpu_id", "random_seed", "enable_deterministic_inference",
        "nnodes", "node_rank", "dist_init_addr")


def engine_args(cfg, hf_dir: str, dtype: str, gpu: int, nnodes: int = 1, node_rank: int = 0,
                dist_init_addr: str | None = None, moe: bool = False) -> dict:
    """Keyword arguments of ``sglang.Engine`` for the ``rollout`` config ``cfg``: the process of
    an engine on node ``node_rank`` of its ``nnodes``, driving GPUs from ``gpu`` on; an engine
    over several nodes meets at ``dist_init_addr`` (host:port of its first process). A ``moe``
    model's engine returns the experts it routed every token to (R3 routing replay)."""
    args = {"model_path": hf_dir, "tp_size": cfg.tp, "dtype": dtype,
            "load_format": "dummy",  # real weights arrive with the first sync
            "enable_memory_saver": True, "mem_fraction_static": cfg.gpu_memory_utilization,
            "base_gpu_id": gpu, "random_seed": cfg.seed}
    if cfg.ep > 1:
        args["ep_size"] = cfg.ep
    if nnodes > 1:
        args.update(nnodes=nnodes, node_rank=node_rank, dist_init_addr=dist_init_addr)
    if cfg.deterministic:
        args["enable_deterministic_inference"] = True
    if moe:
        args["enable_return_routed_experts"] = True
    return {**args, **dict(cfg.engine_args)}


def sampling_args(params, count: int) -> list[dict]:
    """One SGLang sampling-parameter dict per sample of a call (``count`` samples of
    :class:`~megatron_rlhf.rollout.base.SamplingParams` ``params``), each with a
    seed of its own: with one seed for all, deterministic inference would make every sample of a
    GRPO group the same sequence."""
    base = {"max_new_tokens": params.max_tokens, "temperature": params.temperature,
            "top_p": params.top_p, "top_k": params.top_k or -1,
            "stop_token_ids": list(params.stop_token_ids)}
    return [{**base, "sampling_seed": (params.seed * SEED_STRIDE + k) % 2 ** 63}
            for k in range(count)]


def known_names() -> tuple[str, frozenset, frozenset]:
    """(SGLang version, engine argument names, sampling parameter names): the installed SGLang's
    when it imports, else the pinned one's list."""
    try:
        import inspect

        import sglang
        from sglang.srt.sampling.sampling_params import SamplingParams as Sampling
        from sglang.srt.server_args import ServerArgs
    except ImportError:
        from megatron_rlhf.config import sglang_names

        return sglang_names.VERSION, sglang_names.SERVER_ARGS, sglang_names.SAMPLING_PARAMS
    sampling = getattr(Sampling, "__struct_fields__", None) or inspect.signature(Sampling).parameters
    return (sglang.__version__, frozenset(inspect.signature(ServerArgs).parameters),
            frozenset(sampling))


def check_sglang_settings(cfg) -> None:
    """The engine arguments and sampling parameter names of ``rollout`` config ``cfg`` are ones
    SGLang knows, and engine_args overrides none of the backend's own."""
    if cfg.backend != "sglang":
        if cfg.engine_args or cfg.deterministic:
            key = "engine_args" if cfg.engine_args else "deterministic"
            raise UserError(f"config: rollout.{key} applies to rollout.backend=sglang only "
                            f"(the backend is {cfg.backend})")
        return
    taken = sorted(set(cfg.engine_args) & set(OURS))
    if taken:
        raise UserError(f"config: rollout.engine_args sets {', '.join(taken)}, which the rollout "
                        "backend sets from the config itself (rollout.tp, rollout.ep, the placement, "
                        "rollout.gpu_memory_utilization, rollout.seed, rollout.deterministic)")
    version, server, sampling = known_names()
    unknown = sorted(set(engine_args(cfg, "", "bfloat16", 0)) - server)
    if unknown:
        raise UserError(f"config: rollout.engine_args: SGLang {version} has no engine argument "
                        f"{', '.join(unknown)}")
    probe = SimpleNamespace(max_tokens=1, temperature=1.0, top_p=1.0, top_k=0, stop_token_ids=[],
                            seed=0)
    unknown = sorted(set(sampling_args(probe, 1)[0]) - sampling)
    if unknown:
        raise UserError(f"SGLang {version} has no sampling parameter {', '.join(unknown)}: "
                        "megatron_rlhf.config.sglang needs updating for it")
