"""The README's main command: `megatron-rlhf demo` on the embedded tiny default."""

import subprocess
import sys

import pytest

from megatron_rlhf.cli import main


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "megatron_rlhf.cli", "demo", "--out-dir", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("bit-identical: True") == 2
    assert "tp=2: scored 64 pairs" in proc.stdout


def test_demo_never_deletes_foreign_folders(tmp_path, capsys):
    (tmp_path / "precious.txt").write_text("keep")
    assert main(["demo", "--out-dir", str(tmp_path)]) == 2
    assert "was not made by the demo" in capsys.readouterr().err
    assert (tmp_path / "precious.txt").read_text() == "keep"
