"""Bad input found by probing the command-line tools: each is one clear error naming what and
where, raised before any work that could be lost."""

import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rlhf.cli import main
from megatron_rlhf.config.loader import load_config, validate_training_config
from megatron_rlhf.config.ppo_schema import PPOConfig
from megatron_rlhf.config.schema import SFTConfig
from megatron_rlhf.data.prompts import load_prompts
from megatron_rlhf.errors import UserError
from megatron_rlhf.rewards.registry import get_reward_fn


def _last_error(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


@pytest.mark.parametrize("text, message", [
    ("data: [1, 2\n", "not valid YAML"),
    ("- a\n- b\n", "the top level must be a mapping"),
])
def test_broken_yaml_is_named(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=f"config file {path}: {message}"):
        load_config(SFTConfig, str(path), [])


@pytest.mark.parametrize("schema, override", [
    (SFTConfig, "optim.lr=nan"), (PPOConfig, "reward.fn_weight=nan"),
    (PPOConfig, "actor.optim.betas=[0.9,inf]"), (PPOConfig, "algorithm.kl_ctrl.kl_coef=-inf"),
])
def test_non_finite_values_are_named(schema, override):
    key, value = override.split("=")
    value = value.strip("[]").split(",")[-1]
    with pytest.raises(UserError, match=rf"config: {key}(\[1\])?={value} must be a finite number"):
        required = ["model.path=x"] if schema is SFTConfig else ["actor.model_path=x"]
        load_config(schema, None, [*required, "data.train_files=[a.parquet]", override])


def test_a_single_file_is_a_list_of_one(tmp_path):
    path = tmp_path / "sft.yaml"
    path.write_text("data:\n  val_files: b.parquet\n")
    config = load_config(SFTConfig, str(path), ["model.path=x", "data.train_files=a.parquet"])
    assert config.data.train_files == ["a.parquet"] and config.data.val_files == ["b.parquet"]


@pytest.mark.parametrize("override, message", [
    ("optim.weight_decay=-5", "optim.weight_decay=-5.0 must be >= 0"),
    ("optim.clip_grad=-1", "optim.clip_grad=-1.0 must be >= 0"),
])
def test_trainer_optimizer_values_are_checked(override, message):
    config = load_config(SFTConfig, None, ["model.path=x", "data.train_files=[a.parquet]", override])
    with pytest.raises(UserError, match=message):
        validate_training_config(config)


def _prompts(tmp_path, truths, prompts=None):
    path = tmp_path / "prompts.parquet"
    prompts = prompts or ["What is 1 + 2?"] * len(truths)
    pq.write_table(pa.table({"prompt": prompts, "ground_truth": truths}), path)
    return path


def _load(path, tokenizer, check=True):
    fn = get_reward_fn("addition")
    return load_prompts([str(path)], tokenizer, "prompt", "ground_truth", 64, "drop", True,
                        (lambda truth: fn("", truth)) if check else None)


def test_a_ground_truth_the_reward_cannot_read_stops_at_load(tmp_path, tiny_models):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen2_policy"])
    path = _prompts(tmp_path, ["3", "two"])
    with pytest.raises(UserError, match=r"column 'ground_truth' row 1: the reward function "
                                        r"cannot check 'two' \(ValueError"):
        _load(path, tokenizer)
    # Numbers are fine as numbers (answers usually are).
    prompts, _ = _load(_prompts(tmp_path, [3, 12]), tokenizer)
    assert [p.ground_truth for p in prompts] == ["3", "12"]


def test_a_whitespace_prompt_is_empty(tmp_path, tiny_models):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen2_policy"])
    path = _prompts(tmp_path, ["3", "4"], prompts=["What is 1 + 2?", "   "])
    with pytest.raises(UserError, match="column 'prompt' row 1 is null or empty"):
        _load(path, tokenizer, check=False)


def test_a_truncated_safetensors_file_is_named(tiny_models, tmp_path, capsys):
    folder = tmp_path / "trunc"
    shutil.copytree(tiny_models["qwen2_policy"], folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    code, err = _last_error(capsys, ["convert", "hf-to-mcore", "--hf-dir", str(folder),
                                     "--out-dir", str(tmp_path / "out")])
    assert code == 2 and err.startswith(f"error: {weights}: not a readable safetensors file")


def test_a_damaged_megatron_checkpoint_is_named(tiny_models, tmp_path, capsys):
    mcore = tmp_path / "mcore"
    assert main(["convert", "hf-to-mcore", "--hf-dir", str(tiny_models["qwen2_policy"]),
                 "--out-dir", str(mcore)]) == 0
    for shard in (mcore / "model").glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:64])
    code, err = _last_error(capsys, ["convert", "mcore-to-hf", "--mcore-dir", str(mcore),
                                     "--out-dir", str(tmp_path / "hf")])
    assert code == 2 and err.startswith(f"error: checkpoint {mcore} cannot be read")
    assert "may be incomplete or damaged" in err


def test_score_rm_arguments_and_output_are_checked_before_scoring(tiny_models, tmp_path, capsys):
    data = tmp_path / "prefs.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "chosen": ["b"], "rejected": ["c"]}), data)
    mcore = tmp_path / "rm"
    assert main(["convert", "hf-to-mcore", "--hf-dir", str(tiny_models["qwen2_rm"]),
                 "--out-dir", str(mcore)]) == 0
    with pytest.raises(SystemExit) as exit_info:
        main(["score-rm", "--model-dir", str(mcore), "--data", str(data), "--output",
              str(tmp_path / "o.parquet"), "--micro-batch-size", "0"])
    assert exit_info.value.code == 2 and "'0' must be a positive integer" in capsys.readouterr().err
    (tmp_path / "folder.parquet").mkdir()
    code, err = _last_error(capsys, ["score-rm", "--model-dir", str(mcore), "--data", str(data),
                                     "--output", str(tmp_path / "folder.parquet")])
    assert code == 2 and "is a folder" in err
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "chosen": pa.array([], pa.string()),
                             "rejected": pa.array([], pa.string())}), empty)
    code, err = _last_error(capsys, ["score-rm", "--model-dir", str(mcore), "--data", str(empty),
                                     "--output", str(tmp_path / "o.parquet")])
    assert code == 2 and err == f"error: {empty}: no rows to score"


@pytest.mark.parametrize("extra, nproc, message", [
    (["parallel.tp=8"], "8", "parallel layout: "),
    (["data.train_batch_size=6", "data.micro_batch_size_per_rank=2"], "4",
     "data.train_batch_size=6 is not divisible by the data-parallel size 4"),
])
def test_trainer_layouts_fail_once_before_ranks_start(tiny_models, capsys, extra, nproc, message):
    code, err = _last_error(capsys, ["sft", f"model.path={tiny_models['qwen2_policy']}",
                                     "data.train_files=[unused.parquet]", *extra,
                                     "--nproc-per-node", nproc])
    assert code == 2 and err.startswith("error: ") and message in err
    assert "rank" not in err


def test_an_unknown_message_role_is_named():
    from megatron_rlhf.data.chat import as_messages

    with pytest.raises(UserError, match="prompts.parquet: column 'prompt' row 3: unknown message "
                                        "role 'bogus'"):
        as_messages([{"role": "bogus", "content": "hi"}], "user",
                    "prompts.parquet: column 'prompt' row 3")


def test_a_prompt_without_a_user_message_is_named():
    from megatron_rlhf.data.chat import as_messages

    with pytest.raises(UserError, match=r"row 3: a prompt needs a user message \(has system, "
                                        r"assistant\)"):
        as_messages([{"role": "system", "content": "be brief"}, {"role": "assistant", "content": "4"}],
                    "user", "prompts.parquet: column 'prompt' row 3")
    # A response may well be the assistant's turn alone.
    assert as_messages([{"role": "assistant", "content": "4"}], "assistant", "x")[0]["role"] == "assistant"


@pytest.mark.parametrize("agents, message", [
    ("[{name: a, model_path: M}, {name: a, model_path: M}]",
     "error: config: agents[1].name='a' clashes with an earlier agent; agent names must be unique"),
    ("[{name: a, model_path: M}, {name: b}]",
     "error: config: missing required value for agents[1].model_path"),
    ("[{name: a, model_path: M}, {name: b, model_path: ''}]",
     "error: config: agents[1] (b) has no model_path"),
])
def test_bad_agents_are_one_line_and_nothing_is_written(tmp_path, capsys, agents, message):
    out = tmp_path / "run"
    code, line = _last_error(capsys, [
        "ppo", f"agents={agents.replace('M', str(tmp_path))}", f"trainer.output_dir={out}",
        f"data.train_files=[{tmp_path / 'p.parquet'}]", "algorithm.adv_estimator=sppo",
        "actor.policy_loss=sppo", "actor.loss_agg_mode=seq-mean-token-mean", "reward.fn=addition",
        "algorithm.use_kl_in_reward=false"])
    assert code == 2 and line == message
    assert not out.exists()


def test_prompts_without_the_prompt_column_are_named(tmp_path):
    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"question": ["What is 1 + 1?"], "ground_truth": ["2"]}), path)
    with pytest.raises(UserError, match=f"{path}: missing column 'prompt' \\(has question, ground_truth\\)"):
        load_prompts([str(path)], None, "prompt", "ground_truth", 32, "drop", False)
