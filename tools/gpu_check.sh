#!/usr/bin/env bash
# GPU checks for a lent GPU machine: tools/gpu_check.py at each size in $SIZES (default 0.5b 1.5b),
# one process each (nccl world of 1, no Ray). Results (JSON, full logs) go to $OUT.
# The machine has torch and transformers but not megatron-core or omegaconf: carry them as cp312
# wheels in .whl/ (installed into /tmp/site here when present), fetched on a networked machine with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1 omegaconf==2.4.0
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv \
  >"$out/nvidia_smi.csv" 2>&1 || true
rc=0
for size in ${SIZES:-0.5b 1.5b}; do
  PYTHONUNBUFFERED=1 python3 tools/gpu_check.py --size "$size" --out "$out/gpu_check_$size.json" \
    >"$out/gpu_check_$size.log" 2>&1
  status=$?
  grep -v -i -e warn -e '^ *$' "$out/gpu_check_$size.log" | grep -e '^\[gpu_check\]' -e Error -e error | tail -40
  [ "$status" -eq 0 ] || rc=$status
done
exit "$rc"
