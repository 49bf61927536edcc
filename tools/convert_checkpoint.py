"""Convert checkpoints between Hugging Face and Megatron-Core (same as `megatron-rlhf convert`).

    python tools/convert_checkpoint.py hf-to-mcore --hf-dir HF --out-dir MCORE [--tp N --pp M]
    python tools/convert_checkpoint.py mcore-to-hf --mcore-dir MCORE --out-dir HF2
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rlhf.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
