"""Run a multi-process scenario script under torchrun and read the JSON its rank 0 writes."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path


# gloo's pairwise connection set-up between the local ranks failing, not anything the scenario
# computes: "Gloo connectFullMesh failed ... Connection closed by peer" while building a process
# group, in dist_memory.py: once in a CI run of 2026-12-05, then in two CI runs of 2026-12-07
# (both tries, seconds apart, while another torchrun scenario ran on the other worker); not
# reproduced alone or beside that scenario (3 runs). Only that is retried, up to three more
# times a few seconds apart, each said on stderr with the ranks' own frames.
TRANSPORT_SETUP_FAILURE = "Gloo connectFullMesh failed"
RETRIES = 3


def torchrun_results(script: Path, ranks: int, *args, out: Path) -> dict:
    """``torchrun --nproc-per-node ranks script *args out``; the script writes ``out``."""
    import time

    for attempt in range(RETRIES + 1):
        try:
            return _torchrun_once(script, ranks, *args, out=out)
        except TransportSetupFailure as failure:
            if attempt == RETRIES:
                raise
            print(f"[torchrun] {script.name}: {TRANSPORT_SETUP_FAILURE} (try {attempt + 1}); "
                  f"again in {5 * (attempt + 1)} s:\n{failure}", file=sys.stderr)
            time.sleep(5 * (attempt + 1))
    raise AssertionError("unreachable")


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
        # Where each rank was: the scenario's own frames (the tail alone shows only gloo's).
        frames = "\n".join(line for line in stderr.splitlines()
                           if "tests/dist_" in line or "megatron_rlhf/" in line)
        raise TransportSetupFailure(f"{frames[-3000:]}\n...\n{stderr[-3000:]}")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-6000:]
    results = json.loads(out.read_text())
    print(json.dumps(results, indent=2))
    return results
