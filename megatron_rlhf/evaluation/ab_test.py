"""`megatron-rlhf ab-test`: sample two policies on the same prompts with the same seeds, judge
every (A, B) pair, and report win rates with bootstrap intervals over prompts.

    megatron-rlhf ab-test --policy-a CKPT_A --policy-b CKPT_B --prompts PROMPTS.parquet \\
        --judge rm:RM_CKPT | fn:NAME | rm:RM_CKPT,fn:NAME [--samples-per-prompt K] ...

The steps reuse what PPO runs:

1. :func:`check_inputs`: policies, judge, prompts, layout and output folder, before any process
   group exists and before anything is written; bad input is one :class:`UserError`.
2. :func:`generate_side`, once per policy: PPO's ``load_policy`` builds the Megatron model (from a
   megatron_rlhf checkpoint or an HF ``*ForCausalLM`` folder, under ``--tp``), PPO's
   ``WeightSync`` streams it into a rollout engine from ``make_generator`` (the ``hf`` backend),
   and the engine samples. Prompts are cut into global batches; batch ``c`` is sampled with seed
   ``(seed, c)`` on rank ``c mod world``, so A and B get the same batches with the same seeds
   and the samples do not depend on the number of ranks.
3. :func:`judge`: the reward model (PPO's value-model loader, ``score_sequences`` = the value at
   the last token) on each data-parallel rank's slice of the sequences, and/or a registry
   function on the decoded text (as PPO's ``reward.fn``). With both, a pair's score is their sum
   (PPO's reward with unit weights); each part is also reported alone.
4. Rank 0: statistics (:mod:`.ab_stats`) and the Parquet / JSON / PNG files (:mod:`.ab_report`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megatron_rlhf.checkpoint.model_ckpt import META_FILE, check_writable, read_checkpoint_info
from megatron_rlhf.convert.checkpoints import read_hf_arch
from megatron_rlhf.convert.peft import is_peft_folder, peft_base
from megatron_rlhf.checkpoint.hf_io import HFReader
from megatron_rlhf.data.prompts import Prompt, load_prompts
from megatron_rlhf.distributed.layout import ParallelGroups, ParallelLayout
from megatron_rlhf.errors import UserError
from megatron_rlhf.models.hf_config import ModelArch

SIDES = ("a", "b")
PROMPT_KEY, TRUTH_KEY = "prompt", "ground_truth"
RM_MICRO_BATCH = 8  # sequences per reward-model forward
BUCKET_BYTES = 256 * 2 ** 20  # weight-sync bucket


@dataclass(frozen=True)
class Judge:
    """What scores a response: a reward model (``rm``: its path) and/or a registered rule (``fn``)."""

    rm: str | None = None
    fn: str | None = None

    @property
    def spec(self) -> str:
        return ",".join(f"{k}:{v}" for k, v in (("rm", self.rm), ("fn", self.fn)) if v)

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(k for k in ("rm", "fn") if getattr(self, k))


def parse_judge(text: str) -> Judge:
    """``rm:PATH``, ``fn:NAME`` or both joined by a comma (either order), each at most once."""
    usage = "expected rm:REWARD_MODEL, fn:NAME, or both as rm:REWARD_MODEL,fn:NAME"
    parts: dict[str, str] = {}
    for item in text.split(","):
        kind, colon, value = item.strip().partition(":")
        if not colon or kind not in ("rm", "fn") or not value.strip() or kind in parts:
            raise UserError(f"--judge {text!r}: {usage}")
        parts[kind] = value.strip()
    return Judge(**parts)


@dataclass(frozen=True)
class ModelSource:
    """A policy or reward model to load: where its weights, config and tokenizer live."""

    flag: str  # the option that named it, for messages
    path: Path
    arch: ModelArch
    hf_dir: Path
    dtype: torch.dtype


def _resolve(flag: str, path: str) -> ModelSource:
    root = Path(path)
    if (root / META_FILE).is_file():
        info = read_checkpoint_info(root)
        return ModelSource(flag, root, info.arch, info.hf_dir, info.dtype)
    if is_peft_folder(root):  # loaded onto its base, merged (trainers.rl.policy.load_policy)
        base = peft_base(root, flag)
        return ModelSource(flag, root, read_hf_arch(base), base, HFReader(base).dtype())
    if (root / "config.json").is_file():
        try:
            return ModelSource(flag, root, read_hf_arch(root), root, HFReader(root).dtype())
        except UserError as err:
            raise UserError(f"{flag}: {err}") from None
    hint = ""
    if root.is_dir() and any(p.name.startswith("step_") for p in root.iterdir()):
        hint = " (it holds step_* checkpoints: name one of them)"
    raise UserError(f"{flag}: {root} is neither a megatron_rlhf checkpoint nor a Hugging Face "
                    f"model folder{hint}")


def resolve_policy(flag: str, path: str) -> ModelSource:
    """A policy: SFT / PPO-actor checkpoint or HF ``*ForCausalLM`` folder, never a value model."""
    source = _resolve(flag, path)
    if source.arch.kind != "policy":
        raise UserError(f"{flag}: {path} is a reward-model (value) checkpoint, not a policy")
    return source


def resolve_reward_model(path: str) -> ModelSource:
    """A ``train-rm`` checkpoint (or its HF ``*ForSequenceClassification`` export)."""
    source = _resolve("--judge rm", path)
    if source.arch.kind != "value":
        raise UserError(f"--judge rm:{path} is a policy (causal LM), not a reward model (train "
                        "one with `megatron-rlhf train-rm`)")
    return source


@dataclass
class ABInputs:
    """Everything checked before the run: nothing here needs a process group."""

    policies: dict[str, ModelSource]
    judge: Judge
    reward_model: ModelSource | None
    prompts: dict[str, list[Prompt]]  # per side, rendered with that policy's tokenizer
    prompt_values: list  # the Parquet's prompt column (strings or message lists)
    truths: list[str | None]
    layout: ParallelLayout
    out: Path


def _tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.hf_dir, local_files_only=True)


def reward_function(judge: Judge):
    """The ``fn:`` judge resolved through the reward registry (as PPO's ``reward.fn``)."""
    from megatron_rlhf.rewards.registry import resolve

    try:
        return resolve(judge.fn, "--judge fn")
    except UserError as err:
        raise UserError(str(err).removeprefix("config: ")) from None


def _side_prompts(args, source: ModelSource, judge: Judge) -> list[Prompt]:
    """The prompts rendered for one policy; a prompt that leaves no room for ``--max-new-tokens``
    within the model's positions is an error (an evaluation must not cut its prompts)."""
    room = source.arch.max_position_embeddings - args.max_new_tokens
    if room < 1:
        raise UserError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in "
                        f"{source.flag}'s {source.arch.max_position_embeddings} positions")
    from megatron_rlhf.rewards.scorer import RewardScorer

    # As PPO: ground truths only where a built-in reads them, checked without running a user's
    # function here (it runs in the judge's pool, with its timeout and error accounting).
    scorer = RewardScorer({"fn": reward_function(judge)}, workers=0) if judge.fn else None
    prompts, report = load_prompts(
        [args.prompts], _tokenizer(source), PROMPT_KEY, TRUTH_KEY, room, "truncate",
        need_ground_truth=scorer is not None and scorer.needs_ground_truth(),
        check_truth=scorer.check_ground_truth if scorer is not None else None)
    if report.truncated:
        raise UserError(f"{args.prompts}: {report.truncated} prompt(s) are longer than {room} "
                        f"tokens for {source.flag} ({source.arch.max_position_embeddings} positions "
                        f"minus --max-new-tokens {args.max_new_tokens})")
    return prompts


def _world_size(args) -> int:
    from megatron_rlhf.distributed.launch import discover_rank, inside_launch

    return discover_rank().world_size if inside_launch() else args.nproc_per_node


def check_inputs(args) -> ABInputs:
    """Check every input and return what the run needs; :class:`UserError` on the first problem.

    Cheap enough to run in the launcher and again on every rank; writes nothing.
    """
    from megatron_rlhf.data.parquet import read_table

    judge = parse_judge(args.judge)
    if args.temperature < 0:
        raise UserError(f"--temperature {args.temperature} must be >= 0 (0: greedy)")
    policies = {"a": resolve_policy("--policy-a", args.policy_a),
                "b": resolve_policy("--policy-b", args.policy_b)}
    if judge.fn:
        reward_function(judge)
    reward_model = resolve_reward_model(judge.rm) if judge.rm else None
    layout, world = ParallelLayout.of(args), _world_size(args)
    for source in (*policies.values(), *([reward_model] if reward_model else [])):
        try:
            layout.resolve(world, source.arch.shape)
        except UserError as err:
            raise UserError(f"{source.flag} {source.path}: {err}") from None
    table = read_table(args.prompts, (PROMPT_KEY,))
    prompts = {side: _side_prompts(args, policies[side], judge) for side in SIDES}
    if reward_model is not None:
        longest = max(len(p.ids) for side in SIDES for p in prompts[side]) + args.max_new_tokens
        if longest > reward_model.arch.max_position_embeddings:
            raise UserError(f"--judge rm:{judge.rm}: prompt + response can reach {longest} tokens, "
                            f"over the reward model's {reward_model.arch.max_position_embeddings} "
                            "positions; lower --max-new-tokens")
    truths = [p.ground_truth for p in prompts["a"]]
    if Path(args.out).is_file():
        raise UserError(f"--out {args.out} is a file; name a folder")
    out = check_writable(args.out)
    return ABInputs(policies, judge, reward_model, prompts, table.column(PROMPT_KEY).to_pylist(),
                    truths, layout.resolve(world), out)


# ---------------------------------------------------------------------------------- generation
@dataclass
class Samples:
    """One policy's responses, prompt-major: entry ``p * K + k`` is sample ``k`` of prompt ``p``."""

    tokens: list[list[int]]
    finished: list[bool]
    texts: list[str]


def prompt_batches(num_prompts: int, samples_per_prompt: int, batch_size: int) -> list[range]:
    """Consecutive prompt ranges of about ``batch_size`` samples each (at least one prompt)."""
    per_batch = max(1, batch_size // samples_per_prompt)
    return [range(s, min(s + per_batch, num_prompts)) for s in range(0, num_prompts, per_batch)]


def batch_seed(seed: int, batch: int) -> int:
    """The sampling seed of global batch ``batch``: the same for A and B, any world size."""
    return seed * 1_000_003 + batch


def _engine(source: ModelSource, groups: ParallelGroups, tokenizer):
    """A rollout engine holding ``source``'s weights, fed as PPO feeds its engine: the Megatron
    model (under ``groups``' TP) streamed through :class:`WeightSync` into ``load_weights``."""
    from megatron_rlhf.config.ppo_schema import RolloutConfig
    from megatron_rlhf.data.chat import pad_id
    from megatron_rlhf.rollout.engines import make_generator
    from megatron_rlhf.rollout.weight_sync import WeightSync
    from megatron_rlhf.trainers.rl.policy import load_policy

    model, arch, hf_dir, padded = load_policy(str(source.path), groups, source.dtype)
    engine = make_generator(RolloutConfig(backend="hf", tp=1), str(hf_dir), source.dtype,
                            pad_id(tokenizer), tokenizer.eos_token_id, groups)
    WeightSync(model, arch, groups, padded, BUCKET_BYTES).sync(engine.load_weights)
    return engine


def generate_side(source: ModelSource, prompts: list[Prompt], args, groups: ParallelGroups,
                  label: str) -> Samples:
    """``--samples-per-prompt`` responses to every prompt from one policy, on every rank."""
    import torch.distributed as dist
    from tqdm import tqdm

    from megatron_rlhf.rollout.base import SamplingParams

    tokenizer = _tokenizer(source)
    engine = _engine(source, groups, tokenizer)
    batches = prompt_batches(len(prompts), args.samples_per_prompt, args.batch_size)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {}
    for index in tqdm(range(rank, len(batches), world), desc=f"generating {label}", unit="batch",
                      disable=rank != 0):
        params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature,
                                n=args.samples_per_prompt, seed=batch_seed(args.seed, index))
        gens = engine.generate([list(prompts[i].ids) for i in batches[index]], params)
        mine[index] = [(g.tokens, g.finished) for g in gens]  # prompt-major within the batch
    del engine
    parts: list[dict] = [None] * world
    dist.all_gather_object(parts, mine)
    done = {index: gens for part in parts for index, gens in part.items()}
    ordered = [g for index in range(len(batches)) for g in done[index]]
    tokens = [list(t) for t, _ in ordered]
    return Samples(tokens, [f for _, f in ordered],
                   [tokenizer.decode(t, skip_special_tokens=True) for t in tokens])


# ---------------------------------------------------------------------------------- judging
def _same_tokenizer(first, second) -> bool:
    return (first.get_vocab() == second.get_vocab()
            and getattr(first, "chat_template", None) == getattr(second, "chat_template", None))


def reward_model_sequences(inputs: ABInputs, side: str, samples: Samples, k: int, rm_tokenizer):
    """Token ids the reward model reads for each of ``side``'s responses: the policy's own prompt
    and response tokens when the tokenizers agree (what PPO scores), else prompt and decoded
    response rendered again with the reward model's tokenizer (what ``score-rm`` scores)."""
    from megatron_rlhf.data.chat import render_pair

    prompts = inputs.prompts[side]
    if _same_tokenizer(_tokenizer(inputs.policies[side]), rm_tokenizer):
        return [list(prompts[i // k].ids) + samples.tokens[i] for i in range(len(samples.tokens))]
    out = [render_pair(rm_tokenizer, inputs.prompt_values[i // k], text)
           for i, text in enumerate(samples.texts)]
    limit = inputs.reward_model.arch.max_position_embeddings
    if max(len(s) for s in out) > limit:
        raise UserError(f"--judge rm:{inputs.judge.rm}: a prompt + response of "
                        f"{inputs.policies[side].flag} is over the reward model's {limit} "
                        "positions in its tokenizer; lower --max-new-tokens")
    return out


def reward_model_scores(inputs: ABInputs, sequences: list[list[int]], groups: ParallelGroups,
                        pad: int, prompt_of: list[int] | None = None) -> np.ndarray:
    """The reward model's value at the last token of every sequence ``[N]``, on every rank.
    Each data-parallel rank scores its contiguous slice (PPO's ``dp_slice``); ``prompt_of``:
    the prompt of each sequence (the samples of one prompt share it, see ``score_sequences``)."""
    import torch.distributed as dist

    from megatron_rlhf.rewards.rm_scorer import score_sequences
    from megatron_rlhf.trainers.rl.agent import stitch
    from megatron_rlhf.trainers.rl.micro_batches import dp_slice
    from megatron_rlhf.trainers.rl.value_init import build_value_model, resolve_value_source

    source = inputs.reward_model
    model = build_value_model(resolve_value_source(str(source.path), groups.layout), groups,
                              source.dtype, seed=0).eval()
    share = dp_slice(len(sequences), groups.layout.dp, groups.dp_rank)
    values = score_sequences(model, groups, sequences[share], RM_MICRO_BATCH, pad,
                             prompt_of=None if prompt_of is None else prompt_of[share])
    owner = groups.is_last_stage and groups.tp_rank == 0
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (groups.dp_rank, values) if owner else None)
    return np.asarray([v for part in stitch(parts) for v in part], dtype=float)


def function_scores(inputs: ABInputs, samples: dict[str, Samples], k: int) -> dict:
    """The ``fn:`` judge's score of every response, per side ``[P * K]``, through PPO's
    :class:`RewardScorer` (a call that raises scores 0 and is reported in one line, as in PPO)."""
    from megatron_rlhf.rewards.scorer import RewardScorer

    prompts = inputs.prompts["a"]  # ground truth, text and extra columns are the same per side
    out = {}
    with RewardScorer({"fn": reward_function(inputs.judge)}) as scorer:
        for side in SIDES:
            calls = [(text, prompts[i // k].ground_truth, prompts[i // k].text, prompts[i // k].extra)
                     for i, text in enumerate(samples[side].texts)]
            out[side] = np.asarray(scorer.score("fn", calls), dtype=float)
        for line in scorer.drain()[1]:
            print(f"[ab-test] {line}", flush=True)
    return out


def judge(inputs: ABInputs, samples: dict[str, Samples], args, groups: ParallelGroups) -> dict | None:
    """Scores ``[P * K]`` per side, on rank 0 (``None`` elsewhere): ``{"rm": {"a", "b"}, "fn":
    {"a", "b"}, "score": {"a", "b"}}`` with the judges asked for; ``score`` is their sum. Every
    rank takes part in the reward model's scoring; the rule runs on rank 0 alone."""
    import torch.distributed as dist

    k, out = args.samples_per_prompt, {}
    if inputs.judge.rm:
        from megatron_rlhf.data.chat import pad_id

        tokenizer = _tokenizer(inputs.reward_model)
        both = [s for side in SIDES
                for s in reward_model_sequences(inputs, side, samples[side], k, tokenizer)]
        half = len(both) // 2  # side a's P * K samples, then side b's, prompt-major
        values = reward_model_scores(inputs, both, groups, pad_id(tokenizer),
                                     [(i % half) // k for i in range(len(both))])
        out["rm"] = {"a": values[:half], "b": values[half:]}
    if dist.get_rank() != 0:
        return None
    if inputs.judge.fn:
        out["fn"] = function_scores(inputs, samples, k)
    out["score"] = {side: sum(out[part][side] for part in inputs.judge.parts) for side in SIDES}
    return out


# ---------------------------------------------------------------------------------- the job
def run_ab_test(args) -> dict | None:
    """The whole job on every rank; rank 0 writes the files, prints and returns the summary."""
    from megatron_rlhf.distributed.launch import init_distributed
    from megatron_rlhf.distributed.layout import build_parallel_groups
    from megatron_rlhf.evaluation.ab_report import format_summary, write_report

    inputs = check_inputs(args)
    init_distributed()
    groups = build_parallel_groups(inputs.layout, seed=args.seed)
    samples = {side: generate_side(inputs.policies[side], inputs.prompts[side], args, groups,
                                   side.upper()) for side in SIDES}
    scores = judge(inputs, samples, args, groups)
    if scores is None:
        return None
    summary = write_report(inputs, samples, scores, args)
    print(format_summary(summary), flush=True)
    return summary
