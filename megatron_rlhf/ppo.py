"""`python -m megatron_rlhf.ppo --config configs/ppo/tiny_cpu.yaml [key=value ...]`."""

import sys

from megatron_rlhf.cli import main

if __name__ == "__main__":
    sys.exit(main(["ppo", *sys.argv[1:]]))
