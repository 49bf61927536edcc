"""Run a multi-process scenario script under torchrun and read the JSON its rank 0 writes."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path


# gloo's pairwise connection set-up between the local ranks failing, not anything the scenario
# computes: seen once in a CI run (dist_memory.py, "Gloo connectFullMesh failed ... Connection
# closed by peer" while building a process group, 2026-12-05) and not reproduced. Only that is
# retried, once, and said on stderr.
TRANSPORT_SETUP_FAILURE = "Gloo connectFullMesh failed"


def torchrun_results(script: Path, ranks: int, *args, out: Path) -> dict:
    """``torchrun --nproc-per-node ranks script *args out``; the script writes ``out``."""
    try:
        return _torchrun_once(script, ranks, *args, out=out)
    except TransportSetupFailure as failure:
        print(f"[torchrun] {script.name}: {TRANSPORT_SETUP_FAILURE}; one more try:\n{failure}",
              file=sys.stderr)
        return _torchrun_once(script, ranks, *args, out=out)


class TransportSetupFailure(AssertionError):
    pass


def _torchrun_once(script: Path, ranks: int, *args, out: Path) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(ranks), str(script), *map(str, args), str(out)]
    # Its own session, so a timeout kills the ranks too, not only the launcher (orphaned ranks
    # would hold the CPUs for the rest of the suite).
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"{script.name} ran over 900 s:\n{stdout[-3000:]}{stderr[-3000:]}")
    if proc.returncode != 0 and TRANSPORT_SETUP_FAILURE in stderr:
        raise TransportSetupFailure(stderr[-3000:])
    assert proc.returncode == 0, stdout[-3000:] + stderr[-6000:]
    results = json.loads(out.read_text())
    print(json.dumps(results, indent=2))
    return results
