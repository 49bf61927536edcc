"""PPO end to end through the real command: Ray driver, worker groups, HF rollouts, Megatron
updates. The named metrics of a 6-step run, and the runs that must equal it: one agent listed
with every offload switch, and the run killed and signalled at seeded moments and resumed.
The other PPO end-to-end files: test_ppo_guard.py (rollback, layouts), test_ppo_recipes.py,
test_ppo_async.py (SPPO at TP2 resumed, one step off policy); helpers in ppo_helpers.py."""

import json
import signal
import time

import pytest

from tests.ppo_helpers import (FULL_RUN, build_workspace, checkpoint_tensors, finish, metrics,
                               overrides, ppo)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return build_workspace(tmp_path_factory)


@pytest.fixture(scope="module")
def uninterrupted(workspace, tmp_path_factory):
    out = tmp_path_factory.mktemp("ppo_full")
    code, stdout, stderr = finish(ppo(overrides(workspace, out, *FULL_RUN)))
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    return out, stdout


def test_ppo_runs_and_logs_the_named_metrics(uninterrupted):
    out, stdout = uninterrupted
    rows = metrics(out)
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2, 3, 4, 5, 6]
    step = next(r for r in rows if r["step"] == 6 and "actor/pg_loss" in r)
    for key in ("reward/score_mean", "reward/score_median", "reward/oracle_mean", "actor/kl",
                "actor/entropy", "actor/clipfrac", "actor/pg_loss", "critic/vf_loss",
                "critic/vf_explained_var", "response/length_mean", "timing/gen",
                "timing/update_actor", "timing/sync", "throughput/tokens_per_s"):
        assert key in json.loads((out / "metrics.jsonl").read_text().splitlines()[-2]) or key in step, key
    # The KL loss weighs by its own coefficient; the adaptive controller steers the in-reward one.
    updates = [r for r in rows if "actor/pg_loss" in r]
    assert all(r["actor/kl_loss_coef"] == 0.02 for r in updates)
    assert updates[0]["actor/kl_coef"] == 0.05 and updates[-1]["actor/kl_coef"] < 0.05
    # The engine's own log-probs equal the actor's after every in-loop weight sync.
    assert max(r["rollout/logprob_diff_max"] for r in rows if "actor/pg_loss" in r) < 1e-4
    assert any("val/oracle_acc" in r for r in rows)
    assert list((out / "tensorboard").glob("events.*"))
    assert sorted(p.name for p in (out / "checkpoints" / "actor").iterdir()) == ["step_00000004",
                                                                                 "step_00000006"]


# Every offload switch: the colocated actor, reference and critic step aside (trainers/offload.py).
OFFLOAD_ALL = tuple(f"{model}.{part}=true" for model in ("actor.offload", "critic.offload")
                    for part in ("params", "grads", "optimizer")) + ("actor.ref_offload.params=true",)


def test_one_agent_as_a_list_with_offload_is_the_plain_run(workspace, uninterrupted, tmp_path):
    """``agents:`` of one agent with no ``multi_agent.mode`` is the plain run through the same
    loop, and offloading the colocated actor, reference and critic between phases changes
    nothing either (one run checks both, to spare the suite a run): every metrics row with the
    same names (``offload/*`` aside) and (timings aside) values, and the same checkpoints,
    actor and critic, tensor for tensor, bitwise."""
    import torch

    reference = uninterrupted[0]
    out = tmp_path / "listed"
    listed = f"agents=[{{name: solo, model_path: {workspace / 'base'}, world_size: 1}}]"
    code, stdout, stderr = finish(ppo(overrides(workspace, out, *FULL_RUN, listed, *OFFLOAD_ALL)))
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in rows if "actor/pg_loss" in r]
    # Bytes moved every step; the seconds are logged (their size is the benchmark's business).
    assert len(updates) == 6 and all(r["offload/bytes"] > 0 and {"offload/seconds_out",
                                     "offload/seconds_in"} <= set(r) for r in updates)
    # Measured from the storages when each generation started: the trainer had stepped aside.
    assert all(r["offload/resident_bytes_generating"] == 0 for r in updates)
    names = [sorted(k for k in row if not k.startswith("offload/")) for row in rows]
    assert names == [sorted(json.loads(line)) for line in
                     (reference / "metrics.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in r.items() if not k.startswith("offload/")}
            for r in metrics(out)] == metrics(reference)
    assert not (out / "agents").exists()
    for role in ("actor", "critic"):
        steps = sorted(p.name for p in (reference / "checkpoints" / role).iterdir())
        assert sorted(p.name for p in (out / "checkpoints" / role).iterdir()) == steps
        for step in steps:
            ours = checkpoint_tensors(out / "checkpoints" / role / step)
            theirs = checkpoint_tensors(reference / "checkpoints" / role / step)
            assert ours.keys() == theirs.keys() and len(ours) > 10
            assert all(torch.equal(ours[k], theirs[k]) for k in ours), (role, step)


def test_kills_at_seeded_moments_and_a_stop_signal_end_as_the_uninterrupted_run(workspace, uninterrupted, tmp_path):
    """The whole process tree (driver, Ray, workers) SIGKILLed at start-up, during a save and
    mid-step, SIGUSR1 to the driver mid-step (again during the stop's save) and SIGTERM to one
    of its workers, each time relaunched with the same command: every logged value and
    TensorBoard point equals the uninterrupted run's, no row missing or doubled; a finished run
    relaunched does nothing."""
    import random

    import psutil

    from megatron_rlhf.errors import EXIT_STOPPED
    from tests.interrupt import (kill_tree, launch, leftovers, rows, saving, scalars, steady,
                                 wait_until)

    reference = uninterrupted[0]
    out, log = tmp_path / "run", tmp_path / "run.log"
    args = ["ppo", *overrides(workspace, out, *FULL_RUN)]
    moments = random.Random(26)

    def a_step_done(proc) -> bool:
        """This launch logged a step (metrics.jsonl still holds the killed launch's rows until
        the resume trims them, so its progress lines are counted instead)."""
        seen = log.read_text().count("/6 | ")
        return wait_until(proc, lambda: log.read_text().count("/6 | ") > seen)

    proc = launch(args, log)  # start-up: Ray and the workers coming up
    time.sleep(moments.uniform(2.0, 8.0))
    kill_tree(proc)
    proc = launch(args, log)  # SIGTERM to a worker itself, as srun signals every task
    assert a_step_done(proc)
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
               if "RankActor" in " ".join(p.cmdline())]
    assert workers
    workers[0].send_signal(signal.SIGTERM)
    assert proc.wait(timeout=600) == EXIT_STOPPED, log.read_text()[-3000:]
    assert "SIGTERM received by worker group actor" in log.read_text()
    proc = launch(args, log)  # a save
    assert wait_until(proc, lambda: saving(out)), log.read_text()[-3000:]
    kill_tree(proc)
    proc = launch(args, log)  # a stop signal mid-step, another during the stop's save
    assert a_step_done(proc)
    time.sleep(moments.uniform(0.0, 1.0))
    proc.send_signal(signal.SIGUSR1)
    if wait_until(proc, lambda: saving(out)):
        proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=600) == EXIT_STOPPED, log.read_text()[-3000:]
    assert "stopped at step" in log.read_text()
    proc = launch(args, log)  # mid-step: a rollout or an update
    assert a_step_done(proc)
    time.sleep(moments.uniform(0.2, 1.5))
    kill_tree(proc)
    proc = launch(args, log)
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    assert log.read_text().count("resumed from step") >= 3
    assert [r["step"] for r in rows(out)] == [r["step"] for r in rows(reference)]
    assert steady(out) == steady(reference)  # bitwise
    assert scalars(out) == scalars(reference)
    assert leftovers(out) == []
    before = sorted((str(p), p.stat().st_mtime_ns) for p in out.rglob("*"))
    proc = launch(args, tmp_path / "again.log")
    assert proc.wait(timeout=120) == 0
    assert "already finished 6 steps" in (tmp_path / "again.log").read_text()
    assert sorted((str(p), p.stat().st_mtime_ns) for p in out.rglob("*")) == before


def test_bad_config_is_one_clear_line(workspace, tmp_path):
    code, stdout, stderr = finish(ppo(overrides(workspace, tmp_path / "run", "algorithm.adv_estimator=grpo")))
    assert code == 2
    assert stderr.strip().splitlines()[-1].startswith("error: config: algorithm.adv_estimator=grpo")


def test_feedback_tokens_continue_the_chat_template(workspace):
    from transformers import AutoTokenizer

    from megatron_rlhf.rollout.multi_turn import feedback_tokens

    tok = AutoTokenizer.from_pretrained(workspace / "base")
    chat = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"},
            {"role": "user", "content": "Try again."}]
    prompt = tok.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
    answer = "5" + tok.decode([tok.eos_token_id])
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    whole = ids(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    assert ids(prompt) + ids(answer) + feedback_tokens(tok, "Try again.", tok.eos_token_id) == whole
