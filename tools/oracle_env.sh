#!/usr/bin/env bash
# Build the verl 0.9.1 oracle environment, .venv-oracle at the repository root, apart from the
# project's .venv (verl pins other transformers and tensordict releases than we do):
# tests/test_recipes.py runs tests/verl_oracle.py in it and compares verl's own functions with
# ours. Idempotent: a second run installs nothing. With a command, runs it inside the
# environment afterwards:
#   bash tools/oracle_env.sh
#   bash tools/oracle_env.sh python tests/verl_oracle.py cases.pt results.pt
# On failure: exit 1 with one line on stderr saying what failed (pip's output is in build.log).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv-oracle"
python="${PYTHON:-python3}"
stamp="$venv/.oracle-installed"
log="$venv/build.log"

# verl itself comes without its dependencies (ray[default], vllm, datasets, ...: gigabytes we do
# not call). These are what importing verl.trainer.ppo.core_algos and .rollout_corr_helper needs,
# found by importing until nothing was missing, each for the module named:
#   verl: packaging, codetiming; verl.protocol: ray, tensordict; ray: msgpack, protobuf, pyyaml,
#   requests (urllib3, idna, certifi; charset-normalizer quiets its warning), jsonschema (attrs,
#   referencing, rpds-py, jsonschema-specifications); tensordict: pyvers, cloudpickle, orjson;
#   core_algos: omegaconf; verl.utils.torch_functional: transformers (huggingface-hub, httpx,
#   httpcore, h11, regex, tqdm, safetensors, tokenizers).
# transformers and tensordict inside verl 0.9.1's own ranges (<5.11; <=0.10.0); the rest as found.
extras=(
  "verl==0.9.1" "packaging==26.4" "codetiming==1.4.0" "ray==2.60.0" "tensordict==0.10.0"
  "msgpack==1.2.4" "protobuf==7.36.2" "PyYAML==6.0.4" "requests==2.34.2" "urllib3==2.8.0"
  "idna==3.20" "certifi==2026.10.19.post1" "charset-normalizer==3.5.3" "jsonschema==4.26.0"
  "attrs==26.1.0" "referencing==0.37.0" "rpds-py==2026.9.1" "jsonschema-specifications==2025.9.1"
  "pyvers==0.1.0" "cloudpickle==3.1.3" "orjson==3.13.0" "omegaconf==2.4.0"
  "transformers==5.9.0" "huggingface-hub==1.33.0" "httpx==0.29.0" "httpcore==1.0.9" "h11==0.16.0"
  "regex==2026.12.2" "tqdm==4.70.1" "safetensors==0.8.0" "tokenizers==0.22.2"
)

fail() {
  echo "[oracle_env] cannot build $venv: $*" >&2
  exit 1
}

# pip's last error line, for the one-line message.
pip_error() {
  grep -E '^(ERROR|error):' "$log" 2>/dev/null | tail -n 1 || true
}

want="$(sha256sum "$root/tools/oracle_env.sh" | cut -d' ' -f1)"
# Two builds at once (two test runs) would race in one folder: the second waits for the first.
exec 9<"$root/tools/oracle_env.sh"
if command -v flock >/dev/null 2>&1; then flock 9; fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[oracle_env] building $venv (verl 0.9.1, CPU torch; a minute or two)" >&2
  if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv" >/dev/null 2>&1 \
      || fail "'$python -m venv' failed (is python3-venv installed?)"
  fi
  : > "$log"
  # torch and numpy: the project's own (.venv, the same pins), reached through a .pth that puts
  # its site-packages *after* this environment's, so every package installed below wins over
  # the project's; installing torch again was most of this build (about a minute). Without a
  # project environment, torch pinned and first, as tools/in_venv.sh: the CPU wheel.
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  rm -f "$site/project-torch.pth"
  if "$root/.venv/bin/python" -c "import torch, numpy; assert torch.__version__.split('+')[0] == '2.13.0' and numpy.__version__ == '2.4.6'" >>"$log" 2>&1; then
    "$root/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
      > "$site/project-torch.pth"
  else
    "$venv/bin/python" -m pip install -q "torch==2.13.0" "numpy==2.4.6" >>"$log" 2>&1 \
      || fail "pip install torch==2.13.0 numpy==2.4.6 failed: $(pip_error) (log: $log)"
  fi
  "$venv/bin/python" -m pip install -q --no-deps "${extras[@]}" >>"$log" 2>&1 \
    || fail "pip install --no-deps verl==0.9.1 and what it imports failed: $(pip_error) (log: $log)"
  "$venv/bin/python" -c "import verl.trainer.ppo.core_algos, verl.trainer.ppo.rollout_corr_helper, transformers, tensordict
assert transformers.__version__ == '5.9.0' and tensordict.__version__ == '0.10.0', 'verl pins lost'" \
    >>"$log" 2>&1 \
    || fail "verl 0.9.1 does not import: $(grep -E 'Error' "$log" | tail -n 1) (log: $log)"
  echo "$want" > "$stamp"
fi
exec 9<&-
if [ "$#" -gt 0 ]; then
  export PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv"
  cd "$root"
  exec "$@"
fi
