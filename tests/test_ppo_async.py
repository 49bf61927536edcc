"""PPO end to end where processes run apart: SPPO at TP=2 over packed micro-batches killed
mid-save and resumed exactly, and one-step-off generation on a separate rollout group."""

import json
import math

import pytest

from tests.ppo_helpers import build_workspace, finish, metrics, overrides, ppo, teacher_forced

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return build_workspace(tmp_path_factory)


def test_sppo_runs_at_tp2_with_packing_and_resumes_exactly(workspace, tmp_path):
    """SPPO through the real command at TP=2 over packed micro-batches sharing each group's
    prompt, the actor with LoRA
    adapters and the distributed optimizer: a run SIGKILLed while it saves a later step (its
    metrics row already logged, its checkpoint not committed) and relaunched (fresh workers
    loading adapters, optimizer and scheduler) reproduces the uninterrupted run: every value of
    every step, exactly, no row missing or doubled."""
    from tests.interrupt import kill_tree, launch, rows, saving, steady, wait_until

    sppo = ["algorithm.adv_estimator=sppo", "actor.policy_loss=sppo", "actor.sppo_eta=2.0",
            "actor.loss_agg_mode=seq-mean-token-mean", "rollout.n=4", "data.train_batch_size=8",
            "algorithm.use_kl_in_reward=false", "actor.parallel.tp=2", "trainer.n_gpus_per_node=2",
            "data.use_remove_padding=true", "trainer.max_steps=3", "trainer.save_every_steps=1",
            "trainer.keep_last_n=3", "trainer.eval_every_steps=0", "trainer.val_before_train=false",
            "actor.lora.rank=8", "actor.parallel.use_distributed_optimizer=true",
            "reward.fn=tests.reward_helpers:length_in_tens"]
    full = tmp_path / "full"
    code, stdout, stderr = finish(ppo(overrides(workspace, full, *sppo)))
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    reference = [r for r in metrics(full) if "actor/pg_loss" in r]
    assert len(reference) == 3 and all(math.isfinite(r["actor/pg_loss"]) for r in reference)
    assert reference[0]["actor/pg_loss"] > 0  # the squared gap to eta * (win rate - 1/2)
    # Each group's prompt computed once (data.share_prompts, on with packed rows).
    assert all(r["actor/tokens_computed"] < 0.8 * r["actor/tokens_sample"] for r in reference)
    # LoRA: adapters alone train (on every rank's linears), the engine gets merged weights (its
    # log-probs are the trainer's after every sync), the checkpoint records the adapters' spec.
    assert "[ppo actor] LoRA rank 8 on 16 linears of this stage" in stdout
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in reference)
    assert reference[-1]["actor/grad_norm"] > 0
    spec = json.loads((full / "checkpoints" / "actor" / "step_00000003" / "megatron_rlhf.json").read_text())
    assert spec["lora"]["rank"] == 8, spec

    out, log = tmp_path / "killed", tmp_path / "killed.log"
    args = ["ppo", *overrides(workspace, out, *sppo)]
    steps = lambda: [r for r in rows(out) if "actor/pg_loss" in r]  # noqa: E731
    committed = lambda: sorted(int(p.name[5:]) for p in (out / "checkpoints" / "actor").glob("step_*")  # noqa: E731
                               if p.name[5:].isdigit())
    proc = launch(args, log)
    # A save in flight of a step whose row is logged: the relaunch must drop that row.
    assert wait_until(proc, lambda: len(steps()) >= 2 and committed() and saving(out)), \
        log.read_text()[-3000:]
    kill_tree(proc)
    last = committed()[-1]
    assert len(steps()) > last, (len(steps()), last)
    proc = launch(args, log)
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    assert f"resumed from step {last}" in log.read_text()
    assert steady(out) == steady(full)
    assert [r["step"] for r in steps()] == [r["step"] for r in reference] == [1, 2, 3]


def test_one_step_off_policy_on_a_separate_rollout_group(workspace, tmp_path):
    """rollout.max_staleness=1: the rollout group generates step k+1 with the weights of step k
    while the trainers update on step k. With a learning rate too small to move a float32
    weight the samples and losses are the on-policy run's; with lr > 0 each batch after the
    first is one update old, its engine log-probs differ from the trainer's recomputed ones
    (TIS corrects them), and its generation overlapped the previous update."""
    common = ("rollout.placement=separate", "rollout.world_size=1", "trainer.max_steps=3",
              "trainer.eval_every_steps=0", "trainer.val_before_train=false")
    frozen = ("actor.optim.lr=1e-30", "actor.optim.min_lr=1e-30")
    runs = {}
    kept = ("trainer.save_every_steps=1", "trainer.keep_last_n=5", "trainer.rollout_data_dir=rollouts")
    for name, extra in {"on_policy_frozen": frozen, "off_frozen": (*frozen, "rollout.max_staleness=1"),
                        "off": ("rollout.max_staleness=1", *kept)}.items():
        out = tmp_path / name
        code, stdout, stderr = finish(ppo(overrides(workspace, out, *common, *extra)))
        assert code == 0, stdout[-3000:] + stderr[-3000:]
        runs[name] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                      if "actor/pg_loss" in line]
    for a, b in zip(runs["on_policy_frozen"], runs["off_frozen"], strict=True):
        for key in ("actor/pg_loss", "actor/kl", "critic/vf_loss", "reward/score_mean",
                    "response/length_mean"):
            assert abs(a[key] - b[key]) < 1e-5, (key, a[key], b[key])
    assert [r["rollout/staleness"] for r in runs["on_policy_frozen"]] == [0.0, 0.0, 0.0]
    off = runs["off"]
    assert [r["rollout/staleness"] for r in off] == [0.0, 1.0, 1.0]
    assert off[0]["rollout/logprob_diff_max"] < 1e-5  # the first batch is on-policy
    for row in off[1:]:
        assert row["rollout/logprob_diff_max"] > 1e-3  # sampled by the previous weights
        assert row["rollout/is_weight_mean"] != 1.0  # corrected (auto: token TIS)
        assert row["timing/overlap"] > 0  # generated while the previous step updated
        assert 0 < row["busy/rollout"] <= 1 and 0 < row["busy/trainers"] <= 1
    # Batch k was sampled by the weights of step k - 1: the engine's log-probs are those weights'
    # (teacher-forced by transformers on the base model / the step-1 checkpoint), not step k's.
    import torch

    from megatron_rlhf.cli import main

    weights = {0: workspace / "base"}
    for step in (1, 2):
        weights[step] = tmp_path / f"hf_{step}"
        assert main(["convert", "mcore-to-hf", "--mcore-dir",
                     str(tmp_path / "off" / "checkpoints" / "actor" / f"step_{step:08d}"),
                     "--out-dir", str(weights[step])]) == 0
    for step in (1, 2):
        dump = (tmp_path / "off" / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in dump]
        assert {r["weight_version"] for r in rows} == {step - 1}
        engine = torch.tensor([lp for r in rows for lp in r["logprobs"]])
        previous, current = (teacher_forced(weights[v], rows) for v in (step - 1, step))
        assert (engine - previous).abs().max() < 1e-5
        assert (engine - current).abs().max() > 1e-3
