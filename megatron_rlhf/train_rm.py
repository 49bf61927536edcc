"""`python -m megatron_rlhf.train_rm --config configs/rm/tiny_cpu.yaml [key=value ...]`."""

import sys

from megatron_rlhf.cli import main

if __name__ == "__main__":
    sys.exit(main(["train-rm", *sys.argv[1:]]))
