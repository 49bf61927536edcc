"""Offline responses (data.offline_files): reading and checking them, and the importance
weights they train with, against hand-computed values."""

import math
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from megatron_rlhf.config.ppo_schema import PPOConfig
from megatron_rlhf.data.offline import load_offline
from megatron_rlhf.errors import UserError


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The bundled task's tokenizer (trained on its texts, chat template included)."""
    from transformers import AutoTokenizer

    from tests.tiny_models import build_task_workspace

    root = build_task_workspace(tmp_path_factory.mktemp("offline"), train=64, val=8, seed=0)
    return AutoTokenizer.from_pretrained(root / "base")


def _load(tokenizer, path, need_truth=False):
    return load_offline([str(path)], tokenizer, "prompt", "ground_truth", 64, 16, need_truth)


def _reply_tokens(tokenizer, prompt, reply):
    from megatron_rlhf.data.chat import split_prompt_response

    return split_prompt_response(tokenizer, [{"role": "user", "content": prompt}],
                                 [{"role": "assistant", "content": reply}])


def test_offline_rows_become_groups_of_samples(tokenizer, tmp_path):
    head, tokens = _reply_tokens(tokenizer, "What is 2 + 3?", "The answer is 5.")
    table = {"prompt": ["What is 2 + 3?", "What is 2 + 3?", "What is 1 + 1?"],
             "response": ["The answer is 5.", "The answer is 6.", "The answer is 2."],
             "ground_truth": ["5", "5", "2"],
             "behaviour_logprobs": [[-0.5] * len(tokens), None, None]}
    pq.write_table(pa.table(table), tmp_path / "a.parquet")
    with pytest.raises(UserError, match=r"a.parquet: row 1: behaviour_logprobs has NoneType"):
        _load(tokenizer, tmp_path / "a.parquet")
    del table["behaviour_logprobs"]
    pq.write_table(pa.table(table), tmp_path / "b.parquet")
    groups, report = _load(tokenizer, tmp_path / "b.parquet", need_truth=True)
    assert [len(g.samples) for g in groups] == [2, 1] and report["samples"] == 3
    assert list(groups[0].prompt.ids) == head and groups[0].samples[0].tokens == tokens
    assert groups[0].prompt.ground_truth == "5" and groups[0].samples[0].logprobs is None
    # The preference format: chosen and rejected both become samples of their prompt's group.
    pq.write_table(pa.table({"prompt": ["What is 2 + 3?"], "chosen": ["The answer is 5."],
                             "rejected": ["The answer is 7."]}), tmp_path / "c.parquet")
    groups, _ = _load(tokenizer, tmp_path / "c.parquet")
    assert len(groups) == 1 and len(groups[0].samples) == 2


@pytest.mark.parametrize("columns, message", [
    ({"prompt": ["q"], "answer": ["a"]}, "need a 'response' column, or 'chosen' and 'rejected'"),
    ({"prompt": ["q"], "response": [7]}, "row 0: the response is int 7, not a non-empty string"),
    ({"prompt": ["q"], "response": ["a"], "behaviour_logprobs": [[0.5, -1.0, -1.0, -1.0]]},
     "behaviour_logprobs"),
])
def test_bad_offline_files_name_what_and_where(tokenizer, tmp_path, columns, message):
    pq.write_table(pa.table(columns), tmp_path / "bad.parquet")
    with pytest.raises(UserError, match=message):
        _load(tokenizer, tmp_path / "bad.parquet")


def test_offline_only_step_trains_with_hand_computed_importance_weights(tokenizer, tmp_path):
    """A step made of offline samples only: the rollout correction weights each token by
    min(pi_old / pi_behaviour, C) from the file's behaviour log-probs."""
    from megatron_rlhf.trainers.rl.agent import PPORun, Timer

    _, tokens = _reply_tokens(tokenizer, "What is 2 + 3?", "The answer is 5.")
    behaviour = [-1.0, -2.0, -0.5] + [-0.1] * (len(tokens) - 3)
    pq.write_table(pa.table({"prompt": ["What is 2 + 3?"], "response": ["The answer is 5."],
                             "behaviour_logprobs": [behaviour]}), tmp_path / "o.parquet")
    groups, _ = _load(tokenizer, tmp_path / "o.parquet")
    cfg = PPOConfig()
    cfg.data.train_batch_size, cfg.data.offline_fraction = 1, 1.0
    cfg.algorithm.rollout_correction.mode, cfg.algorithm.rollout_correction.tis_cap = "tis", 2.0
    run = SimpleNamespace(cfg=cfg, offline=groups, pad_id=0, train=[None], steps_per_epoch=1)
    for name in ("step_indices", "step_prompts", "offline_groups", "online_prompts", "correct"):
        setattr(run, name, getattr(PPORun, name).__get__(run))
    run.scores = lambda prompts, gens, batch: {"score": torch.zeros(len(gens)), "rm": None,
                                               "turns": None}
    prompts, gens, batch, _, metrics = PPORun.rollout(run, 0, Timer())
    assert metrics == {"offline/samples": 1.0} and gens[0].logprobs == behaviour
    # The trainer's current policy, known here: log-probs -0.5, -2.5, -0.5, -0.1, ...
    mask = batch["loss_mask"]
    first = int(mask[0].nonzero()[0])
    old = torch.zeros_like(mask)
    old[0, first:first + len(tokens)] = torch.tensor([-0.5, -2.5, -0.5] + [-0.1] * (len(tokens) - 3))
    run.actor = SimpleNamespace(call=lambda *args: [(0, (old, None, None, None))])
    PPORun.log_probs(run, batch, gens)
    weights = batch["is_weights"][0, first:first + len(tokens)].tolist()
    # exp(-0.5 + 1) = 1.65; exp(-2.5 + 2) = 0.61; exp(0) = 1 elsewhere; under the cap of 2.
    assert weights == pytest.approx([math.exp(0.5), math.exp(-0.5)] + [1.0] * (len(tokens) - 2))
    assert batch["is_weights"].sum() == pytest.approx(sum(weights))  # nothing off the response
