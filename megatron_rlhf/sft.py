"""`python -m megatron_rlhf.sft --config configs/sft/tiny_cpu.yaml [key=value ...]`."""

import sys

from megatron_rlhf.cli import main

if __name__ == "__main__":
    sys.exit(main(["sft", *sys.argv[1:]]))
