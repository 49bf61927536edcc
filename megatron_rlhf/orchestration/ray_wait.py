"""Wait until a Ray cluster started by a Slurm job has every node and GPU, or say which are not.

Run by ``slurm/lib.sh`` on the head node after it starts one ``ray start`` per node:

    python -m megatron_rlhf.orchestration.ray_wait --address HEAD:PORT --nodes 2 \\
        --gpus-per-node 8 --timeout 300 --expect node1=10.0.0.1,node2=10.0.0.2

Exit 0 once ``--nodes`` nodes are alive with ``--nodes x --gpus-per-node`` GPUs between them;
exit 1 after ``--timeout`` seconds with one line naming the nodes (name and address) that never
joined, or saying that the head never answered.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time


def _head_answers(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return True
    except OSError:
        return False


def missing_nodes(expected: dict[str, str], alive_addresses: set[str]) -> list[str]:
    """``name (address)`` of every expected node whose address no alive Ray node has."""
    return [f"{name} ({ip})" for name, ip in expected.items() if ip not in alive_addresses]


def _parse_expect(text: str) -> dict[str, str]:
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    return {name: ip for name, ip in pairs}


def wait(address: str, nodes: int, gpus_per_node: float, timeout: float,
         expected: dict[str, str]) -> int:
    start = time.monotonic()
    deadline = start + timeout
    while not _head_answers(address):
        if time.monotonic() > deadline:
            print(f"[ray_wait] the Ray head at {address} did not answer within {timeout:.0f} s",
                  flush=True)
            return 1
        time.sleep(1)
    import ray

    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    try:
        while True:
            alive = [n for n in ray.nodes() if n["Alive"]]
            gpus = sum(n["Resources"].get("GPU", 0.0) for n in alive)
            if len(alive) >= nodes and gpus >= nodes * gpus_per_node:
                print(f"[ray_wait] Ray cluster up: {len(alive)} nodes, {gpus:g} GPUs after "
                      f"{time.monotonic() - start:.0f} s", flush=True)
                return 0
            if time.monotonic() > deadline:
                lost = missing_nodes(expected, {n["NodeManagerAddress"] for n in alive})
                print(f"[ray_wait] after {timeout:.0f} s {len(alive)} of {nodes} nodes and "
                      f"{gpus:g} of {nodes * gpus_per_node:g} GPUs have joined; never joined: "
                      f"{', '.join(lost) or 'none named (GPUs missing)'}", flush=True)
                return 1
            time.sleep(1)
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--address", required=True, help="HEAD_IP:PORT")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=float, required=True)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds")
    parser.add_argument("--expect", default="", help="name=address,... of the job's nodes")
    args = parser.parse_args(argv)
    return wait(args.address, args.nodes, args.gpus_per_node, args.timeout,
                _parse_expect(args.expect))


if __name__ == "__main__":
    sys.exit(main())
