"""No code from a checkpoint, ever: a pickle planted in each kind of pickled checkpoint file
(``.metadata``, ``common.pt``, a byte item of a ``.distcp`` shard, an RNG file) is refused with
one line by every command that opens checkpoints, nothing from it runs and nothing is written.

The planted object calls ``os.system("touch MARKER")`` when unpickled; a control test shows the
loaders torch would otherwise use do run it."""

import io
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from megatron_rlhf.cli import main

KINDS = ("metadata", "common", "distcp", "rng")


class Planted:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant(checkpoint: Path, kind: str, marker: Path) -> None:
    """Replace one pickled file (or one byte item inside a shard) of ``checkpoint``."""
    model = checkpoint / "model"
    if kind == "metadata":
        (model / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    elif kind == "common":
        torch.save(Planted(marker), model / "common.pt")
    elif kind == "rng":
        torch.save(Planted(marker), checkpoint / "rng" / "rank_00000.pt")
    elif kind == "distcp":
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        metadata = pickle.loads((model / ".metadata").read_bytes())  # our own, trusted file
        key = next(k for k, v in metadata.state_dict_metadata.items()
                   if isinstance(v, BytesStorageMetadata))
        index = next(i for i in metadata.storage_data if i.fqn == key)
        info = metadata.storage_data[index]
        buffer = io.BytesIO()
        torch.save(Planted(marker), buffer)
        shard = model / info.relative_path
        info.offset, info.length = shard.stat().st_size, len(buffer.getvalue())
        with shard.open("ab") as handle:
            handle.write(buffer.getvalue())
        (model / ".metadata").write_bytes(pickle.dumps(metadata))
    else:
        raise ValueError(kind)


def tree(root: Path) -> dict:
    """Every file under ``root`` with its size and modification time."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A workspace, a reward-model run (2 checkpoints) and an SFT run (2 checkpoints)."""
    from tests.tiny_models import build_task_workspace

    ws = build_task_workspace(tmp_path_factory.mktemp("planted"), train=64, val=16, seed=5)
    data = ws / "data"
    common = ["data.train_batch_size=8", "data.micro_batch_size_per_rank=4",
              "data.max_prompt_length=24", "data.max_response_length=16", "trainer.max_steps=2",
              "trainer.save_every_steps=1", "trainer.logger=console"]
    assert main(["train-rm", "--config", "configs/rm/tiny_cpu.yaml", f"model.path={ws / 'base'}",
                 f"data.train_files=[{data / 'prefs_train.parquet'}]", "data.val_files=[]",
                 f"trainer.output_dir={ws / 'rm'}", *common]) == 0
    assert main(["sft", "--config", "configs/sft/tiny_cpu.yaml", f"model.path={ws / 'base'}",
                 f"data.train_files=[{data / 'sft_train.parquet'}]", "data.val_files=[]",
                 f"trainer.output_dir={ws / 'sft'}", *common]) == 0
    return ws


def _newest(run: Path) -> Path:
    return sorted((run / "checkpoints").glob("step_*"))[-1]


def _refused(capsys, code: int, marker: Path, planted: Path) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err[-5:]
    assert not marker.exists(), "the planted code ran"
    last = err[-1]
    assert last.startswith("error: ") and "refused to unpickle posix.system" in last, last
    assert str(planted) in last, last  # names the file
    assert "Traceback" not in "\n".join(err)
    return last


def _planted_copy(source: Path, tmp_path: Path, kind: str) -> tuple[Path, Path, Path]:
    """A copy of checkpoint ``source`` with ``kind`` planted: (copy, marker, planted file)."""
    copy = tmp_path / source.name
    shutil.copytree(source, copy)
    marker = tmp_path / "MARKER"
    plant(copy, kind, marker)
    planted = {"metadata": copy / "model" / ".metadata", "common": copy / "model" / "common.pt",
               "rng": copy / "rng" / "rank_00000.pt"}.get(kind, copy / "model")
    return copy, marker, planted


def test_the_planted_files_would_run_under_torchs_own_loaders(models, tmp_path):
    """Control: the plants are live. torch's reader (bare pickle.load) runs the .metadata one,
    its load planner's torch.load(weights_only=False) the byte item."""
    for kind in ("metadata", "distcp"):
        copy, marker, _ = _planted_copy(_newest(models / "rm"), tmp_path / kind, kind)
        if kind == "metadata":
            from torch.distributed.checkpoint import FileSystemReader

            with pytest.raises(AttributeError):  # os.system's return value is no Metadata
                FileSystemReader(str(copy / "model")).read_metadata()
        else:
            from megatron_rlhf.checkpoint.safe_load import read_metadata
            from torch.distributed.checkpoint.metadata import BytesStorageMetadata

            metadata = read_metadata(copy / "model" / ".metadata")
            key = next(k for k, v in metadata.state_dict_metadata.items()
                       if isinstance(v, BytesStorageMetadata))
            info = next(v for i, v in metadata.storage_data.items() if i.fqn == key)
            with open(copy / "model" / info.relative_path, "rb") as handle:
                handle.seek(info.offset)
                torch.load(io.BytesIO(handle.read(info.length)), weights_only=False)
        assert marker.exists(), kind


@pytest.mark.parametrize("kind", KINDS)
def test_the_check_refuses_every_kind_and_passes_the_clean_checkpoint(models, tmp_path, kind):
    from megatron_rlhf.checkpoint.safe_load import RefusedCheckpointFile
    from megatron_rlhf.checkpoint.train_ckpt import check_checkpoint_files

    check_checkpoint_files(_newest(models / "rm"))  # the real thing passes
    copy, marker, planted = _planted_copy(_newest(models / "rm"), tmp_path, kind)
    with pytest.raises(RefusedCheckpointFile, match="refused to unpickle posix.system") as err:
        check_checkpoint_files(copy)
    assert str(planted) in str(err.value) and not marker.exists()


def _model_kinds():
    return ("metadata", "common", "distcp")


@pytest.mark.parametrize("kind", _model_kinds())
def test_score_rm_refuses(models, tmp_path, capsys, kind):
    copy, marker, planted = _planted_copy(_newest(models / "rm"), tmp_path, kind)
    out = tmp_path / "scores.parquet"
    code = main(["score-rm", "--model-dir", str(copy), "--data",
                 str(models / "data" / "prefs_val.parquet"), "--output", str(out)])
    _refused(capsys, code, marker, planted)
    assert not out.exists()


@pytest.mark.parametrize("kind", _model_kinds())
def test_convert_mcore_to_hf_refuses(models, tmp_path, capsys, kind):
    copy, marker, planted = _planted_copy(_newest(models / "rm"), tmp_path, kind)
    out = tmp_path / "hf"
    code = main(["convert", "mcore-to-hf", "--mcore-dir", str(copy), "--out-dir", str(out)])
    _refused(capsys, code, marker, planted)
    assert not tree(out) and not tree(tmp_path / "hf.partial")


@pytest.mark.parametrize("kind", _model_kinds())
def test_ab_test_refuses(models, tmp_path, capsys, kind):
    copy, marker, planted = _planted_copy(_newest(models / "sft"), tmp_path, kind)
    out = tmp_path / "ab"
    code = main(["ab-test", "--policy-a", str(copy), "--policy-b", str(models / "base"),
                 "--prompts", str(models / "data" / "prompts_val.parquet"), "--judge",
                 "fn:addition", "--max-new-tokens", "4", "--out", str(out)])
    _refused(capsys, code, marker, planted)
    assert not tree(out)


@pytest.mark.parametrize("job,kind", [(job, kind) for job in ("train-rm", "sft") for kind in KINDS])
def test_resume_refuses_and_writes_nothing(models, tmp_path, capsys, job, kind):
    """The newest checkpoint of a run is planted: the relaunch stops (it does not fall back to
    the checkpoint before, as it does for a damaged one) and the run folder is untouched."""
    source = models / ("rm" if job == "train-rm" else "sft")
    run = tmp_path / "run"
    shutil.copytree(source, run)
    (run / "finished.json").unlink()
    newest = _newest(run)
    marker = tmp_path / "MARKER"
    plant(newest, kind, marker)
    planted = {"metadata": newest / "model" / ".metadata", "common": newest / "model" / "common.pt",
               "rng": newest / "rng" / "rank_00000.pt"}.get(kind, newest / "model")
    before = tree(run)
    data = models / "data" / ("prefs_train.parquet" if job == "train-rm" else "sft_train.parquet")
    code = main([job, "--config", f"configs/{'rm' if job == 'train-rm' else 'sft'}/tiny_cpu.yaml",
                 f"model.path={models / 'base'}", f"data.train_files=[{data}]", "data.val_files=[]",
                 "data.train_batch_size=8", "data.micro_batch_size_per_rank=4",
                 "data.max_prompt_length=24", "data.max_response_length=16",
                 "trainer.max_steps=4", "trainer.logger=console", f"trainer.output_dir={run}"])
    _refused(capsys, code, marker, planted)
    assert tree(run) == before


def _ppo_args(models, out: Path, *extra) -> list[str]:
    data = models / "data"
    return ["ppo", f"actor.model_path={models / 'base'}",
            f"data.train_files=[{data / 'prompts_train.parquet'}]", "data.val_files=[]",
            "data.max_prompt_length=32", "data.max_response_length=8",
            "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
            "actor.ppo_micro_batch_size_per_rank=4", "reward.fn=addition",
            "algorithm.adv_estimator=grpo", "rollout.n=2", "trainer.max_steps=2",
            "trainer.logger=console", f"trainer.output_dir={out}", *extra]


@pytest.mark.parametrize("kind", _model_kinds())
def test_ppo_refuses_a_planted_policy_before_anything_starts(models, tmp_path, capsys, kind):
    copy, marker, planted = _planted_copy(_newest(models / "sft"), tmp_path, kind)
    out = tmp_path / "ppo"
    code = main(_ppo_args(models, out, f"actor.model_path={copy}"))
    _refused(capsys, code, marker, planted)
    assert not tree(out)


@pytest.mark.parametrize("kind", KINDS)
def test_ppo_resume_refuses(models, tmp_path, capsys, kind):
    """A PPO run whose newest actor checkpoint is planted (a policy checkpoint in the place a
    PPO save would put it): the driver refuses it before Ray starts."""
    out = tmp_path / "ppo"
    newest = out / "checkpoints" / "actor" / "step_00000001"
    shutil.copytree(_newest(models / "sft"), newest)
    marker = tmp_path / "MARKER"
    plant(newest, kind, marker)
    planted = {"metadata": newest / "model" / ".metadata", "common": newest / "model" / "common.pt",
               "rng": newest / "rng" / "rank_00000.pt"}.get(kind, newest / "model")
    before = tree(out)
    code = main(_ppo_args(models, out))
    _refused(capsys, code, marker, planted)
    assert tree(out) == before


def test_multi_agent_refuses_an_agents_planted_policy(models, tmp_path, capsys):
    copy, marker, planted = _planted_copy(_newest(models / "sft"), tmp_path, "metadata")
    out = tmp_path / "agents"
    code = main(_ppo_args(models, out, "algorithm.adv_estimator=sppo", "actor.policy_loss=sppo",
                          "actor.loss_agg_mode=seq-mean-token-mean", "multi_agent.mode=population",
                          f"agents=[{{name: a, model_path: {models / 'base'}}},"
                          f"{{name: b, model_path: {copy}}}]"))
    _refused(capsys, code, marker, planted)
    assert not tree(out)


def test_rng_files_written_before_the_safe_format_still_load(models, tmp_path):
    """Older RNG files held numpy's state as an ndarray; they load (numpy's arrays admitted,
    nothing else) and restore the same generators."""
    import random

    import numpy as np

    from megatron_rlhf.checkpoint.safe_load import LEGACY_RNG_GLOBALS, load_torch_file
    from megatron_rlhf.checkpoint.train_ckpt import _set_rng_state

    np.random.seed(7)
    random.seed(7)
    torch.manual_seed(7)
    legacy = {"torch": torch.get_rng_state(), "python": random.getstate(),
              "numpy": np.random.get_state(), "tracker": {}}
    expected = (torch.rand(3), random.random(), np.random.rand(3))
    path = tmp_path / "rank_00000.pt"
    torch.save(legacy, path)
    state = load_torch_file(path, LEGACY_RNG_GLOBALS)
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    saved_tracker = tracker.get_states()
    try:
        state["tracker"] = saved_tracker
        _set_rng_state(state)
        again = (torch.rand(3), random.random(), np.random.rand(3))
    finally:
        tracker.set_states(saved_tracker)
    assert torch.equal(expected[0], again[0]) and expected[1] == again[1]
    assert np.array_equal(expected[2], again[2])
