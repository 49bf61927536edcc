"""`megatron-rlhf demo`: the end-to-end CPU demo on an embedded tiny default.

Today it exercises the foundation: a tiny Qwen2 policy and reward model are built offline,
converted HF -> Megatron -> HF (checked bit for bit), and a preference set is scored with the
reward model at TP=1 and at TP=2 (two local ranks), whose rewards must agree. The reward model is
untrained here, so its pairwise accuracy is near chance.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

from megatron_rlhf.convert.checkpoints import hf_to_mcore, mcore_to_hf
from megatron_rlhf.data.task_files import write_task_files
from megatron_rlhf.errors import UserError
from megatron_rlhf.models.tiny import make_tiny_model, tiny_config, train_tokenizer


def _build_models(root: Path) -> dict[str, Path]:
    sft = pq.read_table(root / "data" / "sft_train.parquet")
    texts = [p + " " + r for p, r in zip(sft.column("prompt").to_pylist(),
                                         sft.column("response").to_pylist())]
    tokenizer = train_tokenizer(texts, root / "tokenizer", vocab_size=300)
    paths = {}
    for kind in ("policy", "value"):
        config = tiny_config("qwen2", kind, vocab_size=len(tokenizer),
                             pad_token_id=tokenizer.pad_token_id)
        paths[kind] = root / f"hf_{kind}"
        make_tiny_model(config, paths[kind])
        tokenizer.save_pretrained(paths[kind])
    return paths


def _bit_identical(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    before, after = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)


def _score(mcore: Path, data: Path, out: Path, tp: int) -> str:
    command = [sys.executable, "-m", "megatron_rlhf.cli", "score-rm", "--model-dir", str(mcore),
               "--data", str(data), "--output", str(out), "--tp", str(tp),
               "--nproc-per-node", str(tp)]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"score-rm at tp={tp} failed:\n{proc.stderr[-2000:]}")
    return proc.stdout.strip().splitlines()[-1]


def run_demo(out_dir: str) -> int:
    root = Path(out_dir)
    marker = root / ".megatron_rlhf_demo"
    if root.exists() and any(root.iterdir()):
        if not marker.exists():
            raise UserError(f"{root} exists and was not made by the demo; choose another --out-dir")
        shutil.rmtree(root)  # only ever a previous demo run's folder
    root.mkdir(parents=True)
    marker.touch()
    start = time.time()
    print(f"[demo] writing the bundled addition task and building a tiny Qwen2 policy and reward "
          f"model under {root}")
    write_task_files(str(root / "data"), train=400, val=64, seed=0)
    hf = _build_models(root)
    rows = []
    for kind, path in hf.items():
        mcore, back = root / f"mcore_{kind}", root / f"hf_{kind}_roundtrip"
        hf_to_mcore(str(path), str(mcore))
        mcore_to_hf(str(mcore), str(back))
        rows.append((kind, _bit_identical(path, back)))
        torch.distributed.destroy_process_group()
    data = root / "data" / "prefs_val.parquet"
    scored = [(tp, _score(root / "mcore_value", data, root / f"scored_tp{tp}.parquet", tp))
              for tp in (1, 2)]
    tp1, tp2 = (pq.read_table(root / f"scored_tp{tp}.parquet") for tp in (1, 2))
    gap = max(abs(a - b) for col in ("chosen_reward", "rejected_reward")
              for a, b in zip(tp1.column(col).to_pylist(), tp2.column(col).to_pylist()))
    print("\n[demo] HF -> Megatron -> HF round trip")
    for kind, same in rows:
        print(f"  {kind:<7} bit-identical: {same}")
    print("[demo] reward scoring (untrained reward model: accuracy near chance is expected)")
    for tp, line in scored:
        print(f"  tp={tp}: {line}")
    print(f"  max |reward(tp=1) - reward(tp=2)| = {gap:.2e}")
    print(f"[demo] done in {time.time() - start:.0f}s; artefacts in {root}")
    return 0 if all(same for _, same in rows) and gap < 1e-4 else 1
