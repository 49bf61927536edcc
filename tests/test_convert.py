"""`megatron-rlhf convert`: bit-identical HF -> Megatron -> HF round trips of every family, a
streaming export whose memory is bounded by one shard and whose output does not depend on how
many processes share it, and clean failures."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from megatron_rlhf.cli import main
from tests.tiny_models import LLAMA3_ROPE

# name -> (family, kind, tiny_config overrides): what tests/tiny_models.py's set lacks
EXPORT_MODELS = {
    "qwen3_policy": ("qwen3", "policy", {}),
    "qwen2_moe_policy": ("qwen2_moe", "policy", {}),
    "qwen3_moe_policy": ("qwen3_moe", "policy", {}),
    "deepseek_v3_policy": ("deepseek_v3", "policy", {}),
    "deepseek_v3_no_q_lora": ("deepseek_v3", "policy", {"q_lora_rank": None}),
    "llama3_rope_policy": ("llama", "policy", {"rope_parameters": LLAMA3_ROPE}),
    "qwen3_moe_rm": ("qwen3_moe", "value", {}),
    "deepseek_v3_rm": ("deepseek_v3", "value", {}),
}


@pytest.fixture(scope="module")
def export_models(tmp_path_factory):
    from megatron_rlhf.models.tiny import make_tiny_model, tiny_config

    root = tmp_path_factory.mktemp("export_models")
    for index, (name, (family, kind, overrides)) in enumerate(EXPORT_MODELS.items()):
        make_tiny_model(tiny_config(family, kind, **overrides), root / name, seed=20 + index)
    return {name: root / name for name in EXPORT_MODELS}


@pytest.fixture(scope="module")
def moe_checkpoint(export_models, tmp_path_factory):
    """A converted DeepSeek-V3 (MLA, shared and routed experts) saved by two pipeline stages, so
    that the exports below, which read at tp=pp=1, reshard as they load."""
    mcore = tmp_path_factory.mktemp("moe_checkpoint") / "mcore"
    assert main(["convert", "hf-to-mcore", "--hf-dir", str(export_models["deepseek_v3_policy"]),
                 "--out-dir", str(mcore), "--pp", "2", "--nproc-per-node", "2"]) == 0
    return mcore


def _hf_tensors(folder):
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def _round_trip(src, tmp_path, *extra):
    mcore, back = tmp_path / "mcore", tmp_path / "hf"
    assert main(["convert", "hf-to-mcore", "--hf-dir", str(src), "--out-dir", str(mcore)]) == 0
    assert main(["convert", "mcore-to-hf", "--mcore-dir", str(mcore), "--out-dir", str(back),
                 *extra]) == 0
    return mcore, back


def _assert_bit_identical(before, after):
    assert sorted(before) == sorted(after)
    for key, tensor in before.items():
        assert after[key].dtype == tensor.dtype and after[key].shape == tensor.shape, key
        assert torch.equal(after[key].view(-1).view(torch.uint8),
                           tensor.view(-1).view(torch.uint8)), key


@pytest.mark.parametrize("name", list(EXPORT_MODELS))
def test_round_trip_is_bit_identical_for_every_family(export_models, tmp_path, name):
    # A small shard size: parameters spread over files, the index must name every tensor.
    _, back = _round_trip(export_models[name], tmp_path, "--max-shard-size", "64KB")
    _assert_bit_identical(_hf_tensors(export_models[name]), _hf_tensors(back))
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(_hf_tensors(back))


@pytest.mark.parametrize("name", ["qwen2_policy", "llama_policy", "qwen2_rm", "llama_rm"])
def test_round_trip_is_bit_identical(tiny_models, tmp_path, name):
    src = tiny_models[name]
    _, back = _round_trip(src, tmp_path)
    assert sorted(p.name for p in back.glob("*.safetensors")) == ["model.safetensors"]
    _assert_bit_identical(_hf_tensors(src), _hf_tensors(back))
    assert json.loads((back / "config.json").read_text()) == json.loads(
        (src / "config.json").read_text())


def _folder_bytes(folder):
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def test_export_over_two_processes_writes_the_same_files(export_models, moe_checkpoint, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["convert", "mcore-to-hf", "--mcore-dir", str(moe_checkpoint), "--out-dir",
                 str(one), "--max-shard-size", "32KB"]) == 0
    shards = list(one.glob("model-*.safetensors"))
    # An odd count: rank 1 runs its last round with nothing to load (the loads are collective).
    assert len(shards) % 2 == 1 and len(shards) > 10
    assert main(["convert", "mcore-to-hf", "--mcore-dir", str(moe_checkpoint), "--out-dir",
                 str(two), "--max-shard-size", "32KB", "--nproc-per-node", "2"]) == 0
    assert _folder_bytes(one) == _folder_bytes(two)
    assert not list(tmp_path.glob("*.partial"))
    _assert_bit_identical(_hf_tensors(export_models["deepseek_v3_policy"]), _hf_tensors(two))


def _recording_hf_reads(monkeypatch):
    """Patch the converter's HF reader to track the bytes of HF tensors alive at once. A read
    buffer lives as long as any view of it (views keep their base), so this counts what a
    conversion still holds, not just what it has read."""
    import weakref

    from megatron_rlhf.checkpoint import hf_io

    state = {"live": 0, "peak": 0, "reads": 0}
    real = hf_io.read_tensor

    def release(nbytes):
        state["live"] -= nbytes

    def read_tensor(path, header, name):
        tensor = real(path, header, name)
        base = tensor._base if tensor._base is not None else tensor
        nbytes = base.numel() * base.element_size()
        weakref.finalize(base, release, nbytes)
        state["live"] += nbytes
        state["reads"] += 1
        state["peak"] = max(state["peak"], state["live"])
        return tensor

    monkeypatch.setattr(hf_io, "read_tensor", read_tensor)
    return state


def test_import_holds_a_few_tensors_at_a_time(tmp_path, monkeypatch):
    # The streamed import: a dozen layers, yet at most two parameters' HF tensors alive at once
    # (the one being written, the previous one kept for its second half).
    from megatron_rlhf.convert.checkpoints import read_hf_arch
    from megatron_rlhf.convert.mapping import layer_offsets, mapped_parameters, rule_for
    from megatron_rlhf.distributed.launch import init_distributed
    from megatron_rlhf.distributed.layout import ParallelLayout, build_parallel_groups
    from megatron_rlhf.models.builder import build_meta_model
    from megatron_rlhf.models.tiny import make_tiny_model, tiny_config

    src = tmp_path / "deep"
    make_tiny_model(tiny_config("qwen3_moe", "policy", num_layers=12), src, seed=3)
    tensors = _hf_tensors(src)
    model_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    arch = read_hf_arch(src)
    init_distributed()
    model = build_meta_model(arch, build_parallel_groups(ParallelLayout(), arch.shape),
                             torch.float32, 256)
    offsets = layer_offsets(model)
    largest = max(sum(tensors[hf].numel() * 4 for hf in rule_for(name, arch, 256, offsets).hf_names)
                  for name, _ in mapped_parameters(model))
    reads = _recording_hf_reads(monkeypatch)
    assert main(["convert", "hf-to-mcore", "--hf-dir", str(src), "--out-dir",
                 str(tmp_path / "mcore")]) == 0
    assert reads["reads"] >= len(tensors)
    assert reads["peak"] <= 2 * largest and model_bytes > 10 * 2 * largest
    assert main(["convert", "mcore-to-hf", "--mcore-dir", str(tmp_path / "mcore"), "--out-dir",
                 str(tmp_path / "back")]) == 0
    _assert_bit_identical(tensors, _hf_tensors(tmp_path / "back"))


def test_import_over_two_processes_shares_the_writing(export_models, tmp_path):
    # Data-parallel replicas split the shards between them (megatron's fully parallel save):
    # both write, and the checkpoint is the model.
    src = export_models["qwen3_moe_policy"]
    mcore = tmp_path / "mcore"
    assert main(["convert", "hf-to-mcore", "--hf-dir", str(src), "--out-dir", str(mcore),
                 "--nproc-per-node", "2"]) == 0
    sizes = sorted(p.stat().st_size for p in (mcore / "model").glob("*.distcp"))
    assert len(sizes) == 2 and sizes[0] > sizes[1] / 3
    assert main(["convert", "mcore-to-hf", "--mcore-dir", str(mcore), "--out-dir",
                 str(tmp_path / "back")]) == 0
    _assert_bit_identical(_hf_tensors(src), _hf_tensors(tmp_path / "back"))


def test_hf_reader_without_memory_map_reads_every_dtype(tmp_path):
    from safetensors.torch import save_file

    from megatron_rlhf.checkpoint.hf_io import HFReader, read_header, read_tensor
    from megatron_rlhf.errors import UserError

    (tmp_path / "config.json").write_text("{}")
    tensors = {"f32": torch.randn(3, 5), "bf16": torch.randn(7).bfloat16(),
               "f16": torch.randn(2, 2, 3).half(), "i64": torch.arange(6).reshape(2, 3),
               "empty": torch.zeros(0, 4)}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reader = HFReader(tmp_path, mmap=False)
    for name, tensor in tensors.items():
        got = reader.get(name)
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
        assert reader.meta(name).shape == tensor.shape and reader.meta(name).is_meta
    header = read_header(tmp_path / "model.safetensors")
    last = max(tensors, key=lambda name: header[name]["data_offsets"][1])
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-8])
    with pytest.raises(UserError, match="model.safetensors: not a readable safetensors file"):
        HFReader(tmp_path, mmap=False)
    with pytest.raises(UserError, match="model.safetensors: cannot read tensor .* truncated"):
        read_tensor(tmp_path / "model.safetensors", header, last)  # sharded folders: no check



def _recording_loads(monkeypatch):
    """Patch megatron's checkpoint load to record (bytes, largest tensor) of each load's result,
    whoever calls it: a whole-model load anywhere in the export shows up here."""
    from megatron.core import dist_checkpointing

    loads, real = [], dist_checkpointing.load

    def load(*args, **kwargs):
        state = real(*args, **kwargs)
        sizes = [t.numel() * t.element_size() for t in _leaves(state)]
        loads.append((sum(sizes), max(sizes, default=0)))
        return state

    monkeypatch.setattr(dist_checkpointing, "load", load)
    return loads


def _leaves(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _leaves(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _leaves(value)


def test_export_loads_one_shard_at_a_time(moe_checkpoint, tmp_path, monkeypatch):
    loads = _recording_loads(monkeypatch)
    shard = 32 * 1024
    assert main(["convert", "mcore-to-hf", "--mcore-dir", str(moe_checkpoint), "--out-dir",
                 str(tmp_path / "hf"), "--max-shard-size", "32KB"]) == 0
    model_bytes = sum(t.numel() * t.element_size() for t in _hf_tensors(tmp_path / "hf").values())
    largest = max(biggest for _, biggest in loads)
    assert len(loads) > 10 and sum(total for total, _ in loads) >= model_bytes > 4 * shard
    assert max(total for total, _ in loads) <= shard + largest


def test_export_builds_the_model_without_its_weights(moe_checkpoint):
    from megatron_rlhf.checkpoint.model_ckpt import read_checkpoint_info
    from megatron_rlhf.convert.streaming_export import meta_model
    from megatron_rlhf.distributed.launch import init_distributed
    from megatron_rlhf.distributed.layout import ParallelLayout, build_parallel_groups

    info = read_checkpoint_info(moe_checkpoint)
    init_distributed()
    model = meta_model(info, build_parallel_groups(ParallelLayout(), info.arch.shape))
    tensors = [t for t in model.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)]
    assert tensors and all(t.is_meta for t in tensors)


def test_shards_pack_in_order_and_rounds_cover_them():
    from megatron_rlhf.convert.streaming_export import ExportPlan, ParamExport, pack_shards

    params = [ParamExport(f"p{i}", size, ((f"h{i}", torch.Size([size])),), torch.uint8, None)
              for i, size in enumerate([3, 3, 3, 10, 1, 2])]
    shards = pack_shards(params, 6)
    assert [[p.name for p in shard] for shard in shards] == [["p0", "p1"], ["p2"], ["p3"],
                                                             ["p4", "p5"]]
    plan = ExportPlan(shards)
    assert plan.rounds(0, 3) == [0, 3] and plan.rounds(2, 3) == [2, None]
    assert plan.file_name(3) == "model-00004-of-00004.safetensors" and plan.total_size() == 22
    assert ExportPlan(shards[:1]).file_name(0) == "model.safetensors"


def test_sharded_export_loads_in_transformers(tiny_models, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    src = tiny_models["qwen2_rm"]
    _, back = _round_trip(src, tmp_path, "--max-shard-size", "40KB")
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert AutoTokenizer.from_pretrained(back).chat_template
    ids = torch.tensor([[5, 9, 33, 120, 7]])
    with torch.no_grad():
        expected = AutoModelForSequenceClassification.from_pretrained(src)(ids).logits
        got = AutoModelForSequenceClassification.from_pretrained(back)(ids).logits
    # The weights are bit-identical (test_round_trip_is_bit_identical); logits computed from two
    # loads are not: CPU kernels may round differently at another memory alignment (1.2e-7 seen
    # on an AMD EPYC for logits near 0.3). 1e-5 is far below any wrong or missing tensor.
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_checkpoint_is_atomic_and_self_describing(tiny_models, tmp_path):
    mcore = tmp_path / "mcore"
    assert main(["convert", "hf-to-mcore", "--hf-dir", str(tiny_models["llama_rm"]),
                 "--out-dir", str(mcore)]) == 0
    meta = json.loads((mcore / "megatron_rlhf.json").read_text())
    assert meta == {"format_version": 1, "kind": "value", "family": "llama", "padded_vocab": 384,
                    "dtype": "float32"}
    assert (mcore / "hf" / "tokenizer.json").is_file() and (mcore / "model" / "metadata.json").is_file()
    assert not list(tmp_path.glob("*.partial"))


def _error_of(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def test_unsupported_architecture(tmp_path, capsys):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path / "gpt2")
    code, err = _error_of(capsys, ["convert", "hf-to-mcore", "--hf-dir", str(tmp_path / "gpt2"),
                                   "--out-dir", str(tmp_path / "out")])
    assert code == 2 and err == "error: unsupported model_type 'gpt2': supported are qwen2, llama, qwen3, qwen2_moe, qwen3_moe, deepseek_v3"


def test_missing_files(tiny_models, tmp_path, capsys):
    code, err = _error_of(capsys, ["convert", "hf-to-mcore", "--hf-dir", str(tmp_path / "nope"),
                                   "--out-dir", str(tmp_path / "out")])
    assert code == 2 and err == f"error: missing config.json in {tmp_path / 'nope'}"
    folder = tmp_path / "weightless"
    folder.mkdir()
    shutil.copy(tiny_models["qwen2_policy"] / "config.json", folder)
    code, err = _error_of(capsys, ["convert", "hf-to-mcore", "--hf-dir", str(folder),
                                   "--out-dir", str(tmp_path / "out")])
    assert code == 2 and "no model.safetensors or model.safetensors.index.json" in err
    for launch in ([], ["--nproc-per-node", "2"]):  # refused before any process starts
        code, err = _error_of(capsys, ["convert", "mcore-to-hf", "--mcore-dir", str(folder),
                                       "--out-dir", str(tmp_path / "out"), *launch])
        assert code == 2 and "is not a complete megatron_rlhf checkpoint" in err


def test_shape_mismatch(tiny_models, tmp_path, capsys):
    folder = tmp_path / "bad"
    shutil.copytree(tiny_models["qwen2_policy"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] += 8
    (folder / "config.json").write_text(json.dumps(config))
    code, err = _error_of(capsys, ["convert", "hf-to-mcore", "--hf-dir", str(folder),
                                   "--out-dir", str(tmp_path / "out")])
    assert code == 2 and err.startswith("error: shape mismatch for model.layers.0.mlp.gate_proj")
    assert not (tmp_path / "out").exists()


def test_refuses_to_overwrite(tiny_models, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("finished work")
    code, err = _error_of(capsys, ["convert", "hf-to-mcore", "--hf-dir",
                                   str(tiny_models["qwen2_policy"]), "--out-dir", str(tmp_path / "out")])
    assert code == 2 and "already exists and is not empty" in err
    assert (tmp_path / "out" / "keep.txt").read_text() == "finished work"


def test_export_refuses_to_overwrite(moe_checkpoint, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("finished work")
    for launch in ([], ["--nproc-per-node", "2"]):
        code, err = _error_of(capsys, ["convert", "mcore-to-hf", "--mcore-dir", str(moe_checkpoint),
                                       "--out-dir", str(tmp_path / "out"), *launch])
        assert code == 2
        assert err == f"error: output folder {tmp_path / 'out'} already exists and is not empty"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["keep.txt"]


def test_cli_error_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_rlhf.cli", "convert", "hf-to-mcore",
                           "--hf-dir", str(tmp_path / "absent"), "--out-dir", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"error: missing config.json in {tmp_path / 'absent'}"


def test_tools_script_converts(tiny_models, tmp_path):
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "tools" / "convert_checkpoint.py"
    proc = subprocess.run([sys.executable, str(script), "hf-to-mcore", "--hf-dir",
                           str(tiny_models["qwen2_policy"]), "--out-dir", str(tmp_path / "m")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "m" / "megatron_rlhf.json").is_file()


def test_a_checkpoint_loads_in_the_dtype_a_trainer_asks_for(tiny_models, tmp_path):
    from megatron_rlhf.checkpoint.model_ckpt import load_model_checkpoint, read_checkpoint_info
    from megatron_rlhf.distributed.launch import init_distributed
    from megatron_rlhf.distributed.layout import ParallelLayout, build_parallel_groups
    from megatron_rlhf.models.builder import build_model

    mcore = tmp_path / "mcore"
    assert main(["convert", "hf-to-mcore", "--hf-dir", str(tiny_models["qwen2_policy"]),
                 "--out-dir", str(mcore)]) == 0
    info = read_checkpoint_info(mcore)
    init_distributed()
    groups = build_parallel_groups(ParallelLayout(), info.arch.shape)
    saved = load_model_checkpoint(info, groups)
    asked = load_model_checkpoint(info, groups, torch.bfloat16)
    assert {p.dtype for p in saved.parameters()} == {torch.float32} and not saved.config.bf16
    # As a bf16 build from scratch: bf16 everywhere but megatron's torch-norm fallback on CPU.
    fresh = build_model(info.arch, groups, torch.bfloat16, info.padded_vocab)
    assert asked.config.bf16 and asked.state_dict().keys() == fresh.state_dict().keys()
    assert {n: p.dtype for n, p in asked.named_parameters()} == {n: p.dtype for n, p in fresh.named_parameters()}
    assert asked.embedding.word_embeddings.weight.dtype == torch.bfloat16
    for (name, a), (_, b) in zip(saved.named_parameters(), asked.named_parameters()):
        assert torch.equal(a.to(b.dtype), b), name  # the saved values, cast


def test_conversions_read_back_and_verify_what_they_wrote(tiny_models, tmp_path, capsys):
    src = tiny_models["qwen2_policy"]
    assert main(["convert", "hf-to-mcore", "--hf-dir", str(src), "--out-dir",
                 str(tmp_path / "mcore")]) == 0
    assert main(["convert", "mcore-to-hf", "--mcore-dir", str(tmp_path / "mcore"), "--out-dir",
                 str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    count = len(_hf_tensors(src))
    assert f"verified: the checkpoint's {count} tensors read back equal the source bitwise" in out
    assert f"verified: {count} tensors read back from the written files equal what was written" in out
    assert main(["convert", "hf-to-mcore", "--hf-dir", str(src), "--out-dir",
                 str(tmp_path / "unchecked"), "--no-verify"]) == 0
    assert "verified" not in capsys.readouterr().out


def _perturbed(path, name):
    """Rewrite the safetensors file ``path`` with tensor ``name`` changed in its last bit."""
    from safetensors.torch import save_file

    tensors = load_file(path)
    flat = tensors[name].view(-1).view(torch.int32)
    flat[0] ^= 1
    save_file(tensors, path)


def test_a_checkpoint_that_differs_from_its_source_is_named_and_left_incomplete(tiny_models, tmp_path, capsys, monkeypatch):
    """The source changes while the conversion runs (another job overwrote it): the read-back
    finds the tensor, the command fails with one line, the output stays OUT.partial."""
    from megatron_rlhf.convert import verify

    src = tmp_path / "src"
    shutil.copytree(tiny_models["qwen2_policy"], src)
    name = "model.layers.1.mlp.down_proj.weight"
    real = verify.verify_checkpoint_against_hf

    def changed_meanwhile(*args, **kwargs):
        _perturbed(src / "model.safetensors", name)
        return real(*args, **kwargs)

    monkeypatch.setattr(verify, "verify_checkpoint_against_hf", changed_meanwhile)
    out = tmp_path / "mcore"
    assert main(["convert", "hf-to-mcore", "--hf-dir", str(src), "--out-dir", str(out)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: convert hf-to-mcore: verification failed: ") and name in last
    assert not out.exists() and (tmp_path / "mcore.partial").is_dir()
    assert not (tmp_path / "mcore.partial" / "megatron_rlhf.json").exists()


def test_an_exported_file_that_reads_back_wrong_is_named_and_left_incomplete(tiny_models, tmp_path, capsys, monkeypatch):
    from megatron_rlhf.convert import compare

    mcore = tmp_path / "mcore"
    assert main(["convert", "hf-to-mcore", "--hf-dir", str(tiny_models["qwen2_policy"]),
                 "--out-dir", str(mcore), "--no-verify"]) == 0
    name = "model.embed_tokens.weight"
    real = compare.check_written_shard

    def corrupted_on_disk(path, tensors):
        _perturbed(path, name)
        return real(path, tensors)

    monkeypatch.setattr(compare, "check_written_shard", corrupted_on_disk)
    out = tmp_path / "hf"
    assert main(["convert", "mcore-to-hf", "--mcore-dir", str(mcore), "--out-dir", str(out)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: convert mcore-to-hf: verification failed: ") and name in last
    assert not out.exists() and (tmp_path / "hf.partial").is_dir()
