"""In CI (``CI=true``) a test that needs a real component fails when it is missing; elsewhere it
skips (tests/conftest.py). Checked by running a small test file under pytest both ways."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = '''
import pytest
from tests.conftest import missing

def test_needs_a_component():
    missing("the frobnicator (apt-get install frobnicator)")

def test_imports_an_absent_module():
    pytest.importorskip("no_such_module_for_the_ci_rule")

def test_plain():
    assert True
'''


@pytest.mark.parametrize("ci", [False, True], ids=["local", "ci"])
def test_a_missing_component_skips_locally_and_fails_in_ci(tmp_path, ci):
    probe = REPO / "tests" / f"_ci_probe_{os.getpid()}_{int(ci)}_test.py"
    probe.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "REQUIRE_SLURM")}
    if ci:
        env["CI"] = "true"
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-o", "addopts=",
                               "-rA", "-q", str(probe)], capture_output=True, text=True, cwd=REPO,
                              env=env, timeout=120)
    finally:
        probe.unlink()
    out = proc.stdout + proc.stderr
    if ci:
        assert proc.returncode == 1 and "2 failed, 1 passed" in out, out
        assert "CI requires the frobnicator (apt-get install frobnicator)" in out, out
        assert "skipped in CI, where every test must run" in out and "no_such_module" in out, out
    else:
        assert proc.returncode == 0 and "1 passed, 2 skipped" in out, out
        assert "the frobnicator" in out, out
