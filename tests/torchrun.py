"""Run a multi-process scenario script under torchrun and read the JSON its rank 0 writes."""

import json
import os
import subprocess
import sys
from pathlib import Path


def torchrun_results(script: Path, ranks: int, *args, out: Path) -> dict:
    """``torchrun --nproc-per-node ranks script *args out``; the script writes ``out``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(ranks), str(script), *map(str, args), str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = json.loads(out.read_text())
    print(json.dumps(results, indent=2))
    return results
