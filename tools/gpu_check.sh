#!/usr/bin/env bash
# GPU checks for a lent GPU machine (one call, a few minutes on one H200, no network, no Ray):
# tools/gpu_check.py (import parity, bf16 training step and MFU, each offload switch: bytes freed
# and seconds against the planner, the hf engine fed by the sync) on a 0.5B-class model (configs/models/qwen2.5-0.5b) and an 8B-class one
# (configs/models/qwen3-8b cut to 8 layers so that its training state fits one GPU), one process
# each (nccl world of 1). Results (JSON, full logs) go to $OUT. Without a GPU it says so and
# exits 0.
# The machine has torch and transformers but not megatron-core or omegaconf: carry them as cp312
# wheels in .whl/ (installed into /tmp/site here when present), fetched on a networked machine with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1 omegaconf==2.4.0
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
if ! python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "[gpu_check] no GPU here (torch sees no CUDA device): nothing to check"
  exit 0
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv \
  >"$out/nvidia_smi.csv" 2>&1 || true
rc=0
# name|model|extra arguments
for spec in "qwen2.5-0.5b|configs/models/qwen2.5-0.5b|" \
            "qwen3-8b-8layers|configs/models/qwen3-8b|--layers 8"; do
  IFS='|' read -r name model extra <<<"$spec"
  # shellcheck disable=SC2086  # $extra is a list of arguments
  PYTHONUNBUFFERED=1 python3 tools/gpu_check.py --model "$model" $extra \
    --out "$out/gpu_check_$name.json" >"$out/gpu_check_$name.log" 2>&1
  status=$?
  grep -e '^\[gpu_check\]' -e Error "$out/gpu_check_$name.log" | grep -v -i warn | tail -40
  [ "$status" -eq 0 ] || rc=$status
done
exit "$rc"
