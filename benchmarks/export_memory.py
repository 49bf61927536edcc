"""Peak memory of ``megatron-rlhf convert mcore-to-hf`` against model size and ``--max-shard-size``.

For each model size: write a random fp32 Qwen2-shaped HF folder straight to safetensors (one
tensor in memory at a time, ~1 GiB files), convert it HF -> Megatron in a child process, then
export it back in a child process per shard size, and read each child's peak RSS from the
kernel (``os.wait4``'s ``ru_maxrss``, through a small launcher process). The models differ only
in depth, so their largest tensor is the same and a streaming export's peak should not depend on
the size at a fixed shard size (nor, for the import, at all).
Each export is checked tensor by tensor against the source before it is deleted.

    python benchmarks/export_memory.py                  # ~1 GB and ~4 GB models
    python benchmarks/export_memory.py --layers 4 20    # a quick run
    python benchmarks/export_memory.py --verify both    # what the read-back verification adds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN, FFN, VOCAB = 1024, 2816, 32000
GiB, MiB = 2**30, 2**20


def _qwen2_config(layers: int):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                       num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=2,
                       max_position_embeddings=4096, tie_word_embeddings=False,
                       architectures=["Qwen2ForCausalLM"], dtype="float32")


def write_random_model(out: Path, layers: int, file_bytes: int = GiB) -> int:
    """A random Qwen2 folder: names and shapes from transformers' own model built on the meta
    device, values generated and written one ~1 GiB file at a time. Returns the tensor bytes."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    config = _qwen2_config(layers)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}
    out.mkdir(parents=True)
    config.save_pretrained(out)
    generator = torch.Generator().manual_seed(0)
    files, pending, size, total = [], {}, 0, 0
    for name, shape in list(shapes.items()) + [(None, None)]:
        nbytes = shape.numel() * 4 if name else 0
        if pending and (name is None or size + nbytes > file_bytes):
            files.append(list(pending))
            save_file(pending, out / f"part-{len(files):05d}.safetensors",
                      metadata={"format": "pt"})
            pending, size = {}, 0
        if name:
            pending[name] = torch.randn(shape, generator=generator) * 0.02
            size, total = size + nbytes, total + nbytes
    weight_map = {name: f"part-{i + 1:05d}.safetensors"
                  for i, part in enumerate(files) for name in part}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "megatron_rlhf.cli", *args]


# Runs the measured command as its own child and prints that child's peak RSS. Measured from
# here directly, ru_maxrss would be at least this (large) process's: on Linux a child's
# high-water mark starts from the memory it was forked from, even when it execs at once.
_LAUNCHER = """
import os, subprocess, sys
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(proc.pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)
"""


def peak_rss(command: list[str]) -> tuple[int, float]:
    """Run ``command``; return its peak resident set size in bytes and its seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _LAUNCHER, *command], capture_output=True,
                          text=True, env=env)
    code, maxrss_kib = map(int, proc.stdout.split()[-2:])
    if proc.returncode or code:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    return maxrss_kib * 1024, time.perf_counter() - start


def same_tensors(src: Path, exported: Path) -> int:
    """Every tensor of ``src`` is in ``exported`` with the same bytes; one pair at a time."""
    import torch

    from megatron_rlhf.checkpoint.hf_io import HFReader

    before, after = HFReader(src), HFReader(exported)
    if sorted(before.names()) != sorted(after.names()):
        raise AssertionError(f"{exported}: tensor names differ from {src}")
    for name in before.names():
        if not torch.equal(before.get(name), after.get(name)):
            raise AssertionError(f"{exported}: {name} differs from {src}")
    return len(before.names())


def _size_arg(nbytes: int) -> str:
    return f"{nbytes // MiB}MB" if nbytes < GiB else f"{nbytes // GiB}GB"


def run(root: Path, layer_counts: list[int], shard_sizes: list[int],
        verify_modes: tuple[bool, ...] = (True,)) -> list[dict]:
    baseline, _ = peak_rss([sys.executable, "-c", "import megatron.core.dist_checkpointing, "
                            "megatron_rlhf.cli, megatron_rlhf.convert.streaming_export"])
    rows = [{"model": "imports only", "shard": "-", "peak": baseline, "seconds": 0.0}]
    for layers in layer_counts:
        hf, mcore = root / f"hf-{layers}", root / f"mcore-{layers}"
        model_bytes = write_random_model(hf, layers)
        label = f"{layers} layers, {model_bytes / GiB:.2f} GiB"
        for verify in verify_modes:
            flag = [] if verify else ["--no-verify"]
            shutil.rmtree(mcore, ignore_errors=True)
            to_mcore, seconds = peak_rss(_cli("convert", "hf-to-mcore", "--hf-dir", str(hf),
                                              "--out-dir", str(mcore), *flag))
            rows.append({"model": label, "direction": "hf-to-mcore", "shard": "-",
                         "verify": verify, "files": len(list(hf.glob("*.safetensors"))),
                         "peak": to_mcore, "seconds": seconds})
            print(f"[{label}] hf-to-mcore verify={verify}: peak {to_mcore / GiB:.2f} GiB, "
                  f"{seconds:.0f} s", flush=True)
        for shard in shard_sizes:
            for verify in verify_modes:
                out = root / f"export-{layers}-{shard}"
                flag = [] if verify else ["--no-verify"]
                peak, seconds = peak_rss(_cli("convert", "mcore-to-hf", "--mcore-dir", str(mcore),
                                              "--out-dir", str(out), "--max-shard-size",
                                              _size_arg(shard), *flag))
                count = same_tensors(hf, out)
                files = len(list(out.glob("*.safetensors")))
                rows.append({"model": label, "direction": "mcore-to-hf", "verify": verify,
                             "shard": _size_arg(shard), "files": files,
                             "tensors": count, "peak": peak, "seconds": seconds})
                print(f"[{label}] mcore-to-hf --max-shard-size {_size_arg(shard)} verify={verify}:"
                      f" peak {peak / GiB:.2f} GiB, {files} files, {count} tensors equal, "
                      f"{seconds:.0f} s", flush=True)
                shutil.rmtree(out)
        shutil.rmtree(hf)
        shutil.rmtree(mcore)
    return rows


def print_table(rows: list[dict]) -> None:
    print("\n| model | direction | --max-shard-size | verify | files | peak RSS (GiB) "
          "| peak - imports (GiB) | time (s) |")
    print("|---|---|---|---|---|---|---|---|")
    base = rows[0]["peak"]
    for row in rows:
        extra = "-" if row["model"] == "imports only" else f"{(row['peak'] - base) / GiB:.2f}"
        verify = {True: "yes", False: "no"}.get(row.get("verify"), "-")
        print(f"| {row['model']} | {row.get('direction', '-')} | {row['shard']} | {verify} | "
              f"{row.get('files', '-')} | "
              f"{row['peak'] / GiB:.2f} | {extra} | {row['seconds']:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[18, 92],
                        help="decoder layers per model (18: ~1 GB, 92: ~4 GB in fp32)")
    parser.add_argument("--shard-mb", type=int, nargs="+", default=[5 * 1024, 500],
                        help="--max-shard-size values in MiB")
    parser.add_argument("--work-dir", default=None, help="scratch folder (default: a new /tmp one)")
    parser.add_argument("--verify", choices=("on", "off", "both"), default="on",
                        help="conversions with their read-back verification, without, or both")
    args = parser.parse_args()
    root = Path(args.work_dir or tempfile.mkdtemp(prefix="export_memory_"))
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    print(f"scratch {root}: {free / GiB:.0f} GiB free", flush=True)
    try:
        modes = {"on": (True,), "off": (False,), "both": (False, True)}[args.verify]
        rows = run(root, args.layers, [mb * MiB for mb in args.shard_mb], modes)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_table(rows)


if __name__ == "__main__":
    main()
