"""The GPU image's pins (docker/constraints-gpu.txt) checked against what the pinned packages
themselves require, and against setup.py.

    python tools/gpu_pins.py            # check (offline): exit 1 naming every conflict
    python tools/gpu_pins.py --refresh  # re-read each pinned release's requirements from PyPI
                                        # (and SGLang's argument names, config/sglang_names.py)

The check reads docker/gpu_requires.json: for every pin, the ``Requires-Dist`` lines of that exact
release (its cp312 manylinux wheel, or its sdist's PKG-INFO), kept beside the pins so that CI
needs no network. A requirement counts when its marker holds for the image (CPython 3.12, Linux,
x86_64) and it names another pinned package; the pinned version must then satisfy it. setup.py's
own ranges (install_requires and the ``gpu`` extra) must hold for the pins too.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import urllib.request
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PINS = ROOT / "docker" / "constraints-gpu.txt"
REQUIRES = ROOT / "docker" / "gpu_requires.json"
# The image: NGC PyTorch 25.xx (Python 3.12, CUDA 13) on x86_64.
IMAGE = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
         "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
         "implementation_name": "cpython", "platform_python_implementation": "CPython",
         "os_name": "posix", "extra": ""}
# Wheels too large to fetch for their metadata; their requirements name none of the other pins
# (torch's are its CUDA libraries and triton).
SKIP_METADATA = {"torch"}


def read_pins(path: Path = PINS) -> dict[str, str]:
    """``name -> version`` of every ``name==version`` line."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        if match is None:
            raise ValueError(f"{path}: {line!r} is not an exact pin (name==version)")
        pins[canonicalize_name(match.group(1))] = match.group(2)
    return pins


def setup_requirements() -> list[str]:
    """install_requires and the gpu extra of setup.py, read without running it."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    nodes = {node.targets[0].id: node.value for node in tree.body
             if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)}
    extras = nodes["EXTRAS"]
    gpu = next(v for k, v in zip(extras.keys, extras.values) if ast.literal_eval(k) == "gpu")
    return list(ast.literal_eval(nodes["INSTALL_REQUIRES"])) + list(ast.literal_eval(gpu))


def conflicts(pins: dict[str, str], requires: dict[str, list[str]],
              setup: list[str]) -> list[str]:
    """Every requirement a pin breaks, one line each (empty: consistent)."""
    found = []
    missing = sorted(set(pins) - SKIP_METADATA - {canonicalize_name(k.split("==")[0])
                                                  for k in requires})
    found += [f"{name}=={pins[name]}: no requirements recorded (run --refresh)" for name in missing]
    for owner, lines in sorted(requires.items()):
        name, version = owner.split("==")
        if pins.get(canonicalize_name(name)) != version:
            found.append(f"{owner}: recorded, but the pin is {pins.get(canonicalize_name(name))}"
                         " (run --refresh)")
        found += _broken(owner, lines, pins)
    found += _broken("setup.py", setup, pins)
    return found


def _broken(owner: str, lines: list[str], pins: dict[str, str]) -> list[str]:
    found = []
    for line in lines:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(IMAGE):
            continue
        name = canonicalize_name(req.name)
        if name in pins and not req.specifier.contains(pins[name], prereleases=True):
            found.append(f"{owner} requires {req}, but {name} is pinned to {pins[name]}")
    return found


def _metadata_from_wheel(path: Path) -> str:
    with zipfile.ZipFile(path) as wheel:
        name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        return wheel.read(name).decode()


def _metadata_from_sdist(name: str, version: str) -> str:
    request = urllib.request.Request(f"https://pypi.org/simple/{name}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    files = json.load(urllib.request.urlopen(request, timeout=60))["files"]
    sdist = next(f["url"] for f in files
                 if f["filename"].endswith(".tar.gz") and f"-{version}.tar.gz" in f["filename"])
    data = urllib.request.urlopen(sdist, timeout=300).read()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        member = min((m for m in tar.getmembers() if m.name.endswith("/PKG-INFO")),
                     key=lambda m: m.name.count("/"))
        return tar.extractfile(member).read().decode()


def _requires_dist(metadata: str) -> list[str]:
    return [line.split(":", 1)[1].strip() for line in metadata.splitlines()
            if line.startswith("Requires-Dist:") and "extra ==" not in line]


SGLANG_NAMES = ROOT / "megatron_rlhf" / "config" / "sglang_names.py"


def _struct_fields(source: str, classes: set[str] | None = None) -> set[str]:
    """Annotated field names of the (msgspec) classes in ``source`` (all classes, or ``classes``)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and (classes is None or node.name in classes):
            names |= {item.target.id for item in node.body
                      if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                      and not item.target.id.startswith("_")}
    return names


def write_sglang_names(wheel: Path, version: str) -> None:
    """The names SGLang ``version`` accepts as engine (server) arguments and sampling parameters,
    read from its wheel's source (ServerArgs is assembled from ``srt/arg_groups/fields``)."""
    with zipfile.ZipFile(wheel) as whl:
        server = set()
        for name in whl.namelist():
            if name.startswith("sglang/srt/arg_groups/fields/") and name.endswith(".py"):
                server |= _struct_fields(whl.read(name).decode())
        sampling = _struct_fields(whl.read("sglang/srt/sampling/sampling_params.py").decode(),
                                  {"SamplingParams"})
    def names(values: set[str]) -> str:
        body = textwrap.fill(" ".join(repr(v) + "," for v in sorted(values)), 96,
                             initial_indent="    ", subsequent_indent="    ")
        return "frozenset((\n" + body + "\n))"

    SGLANG_NAMES.write_text(
        f'"""Written by tools/gpu_pins.py from the wheel of SGLang {version}: the engine arguments\n'
        "and sampling parameters it accepts, to check ours against where SGLang is not installed."
        '"""\n\n'
        f'VERSION = "{version}"\n'
        f"SERVER_ARGS = {names(server)}\n"
        f"SAMPLING_PARAMS = {names(sampling)}\n")


def refresh(pins: dict[str, str]) -> dict[str, list[str]]:
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, version in sorted(pins.items()):
            if name in SKIP_METADATA:
                continue
            print(f"[gpu_pins] {name}=={version}", flush=True)
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--isolated", "-q", "--no-deps",
                 "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                 "--platform", "manylinux_2_34_x86_64", "--platform", "manylinux_2_28_x86_64",
                 "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
                 "-d", tmp, f"{name}=={version}"],
                capture_output=True, text=True)
            wheels = [p for p in Path(tmp).glob("*.whl")
                      if canonicalize_name(p.name.split("-")[0]) == name]
            metadata = (_metadata_from_wheel(wheels[0]) if proc.returncode == 0 and wheels
                        else _metadata_from_sdist(name, version))
            found[f"{name}=={version}"] = _requires_dist(metadata)
            if name == "sglang":
                write_sglang_names(wheels[0], version)
            for wheel in wheels:
                wheel.unlink()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--refresh", action="store_true",
                        help="read each pinned release's requirements from PyPI first")
    args = parser.parse_args(argv)
    pins = read_pins()
    if args.refresh:
        REQUIRES.write_text(json.dumps(refresh(pins), indent=1, sort_keys=True) + "\n")
    found = conflicts(pins, json.loads(REQUIRES.read_text()), setup_requirements())
    for line in found:
        print(f"[gpu_pins] {line}")
    if not found:
        print(f"[gpu_pins] {len(pins)} pins consistent with each other and with setup.py")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
