"""DAPO, GSPO, REINFORCE++, the new loss aggregations and rollout correction: pure functions
against hand-computed values and slow loops; and the math we share with verl (loss aggregation,
GAE, GRPO, RLOO, REINFORCE++ and its baseline, KL estimators, the PPO and GSPO losses with their
gradients, value loss, entropy, the adaptive KL controller, TIS weights, sequence masks) against
verl 0.9.1's own functions, which tests/verl_oracle.py runs in an environment of their own
(.venv-oracle, built on first use by tools/oracle_env.sh; CI fails without it, elsewhere those
tests skip)."""

import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from megatron_rlhf.algorithms import advantages as adv
from megatron_rlhf.algorithms import dapo, ppo, rollout_correction
from tests.conftest import missing

ROOT = Path(__file__).resolve().parents[1]

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # last row empty


def test_new_aggregation_modes_by_hand():
    assert ppo.aggregate(LOSS, MASK, "token-sum").item() == pytest.approx(10.0)
    # Dr. GRPO: per-sequence sums over a constant horizon (8), mean over the 2 non-empty rows.
    assert ppo.aggregate(LOSS, MASK, "seq-mean-token-sum-norm", horizon=8).item() == \
        pytest.approx((6.0 / 8 + 4.0 / 8) / 2)
    with pytest.raises(ValueError, match="horizon"):
        ppo.aggregate(LOSS, MASK, "seq-mean-token-sum-norm")


@pytest.mark.parametrize("mode", ppo.AGG_MODES)
def test_micro_batches_add_up_to_the_whole(mode):
    # What the trainer does: each micro-batch's aggregate times its denominator, summed, over
    # the mini-batch's denominator, must be the mini-batch's own aggregate.
    generator = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 5, generator=generator)
    mask = (torch.rand(6, 5, generator=generator) > 0.3).float()
    mask[2] = 0.0
    whole = ppo.aggregate(loss, mask, mode, horizon=7)
    parts = [(loss[i:i + 2], mask[i:i + 2]) for i in range(0, 6, 2)]
    total = sum(ppo.aggregate(l, m, mode, 7) * ppo.aggregate_denominator(m, mode, 7) for l, m in parts)
    assert (total / ppo.aggregate_denominator(mask, mode, 7)).item() == pytest.approx(whole.item(), abs=1e-6)


def gspo_loop(old, new, advantages, mask, low, high):
    """Reference GSPO objective, one sequence at a time (value only)."""
    losses = []
    for i in range(old.shape[0]):
        valid = [t for t in range(old.shape[1]) if mask[i, t]]
        if not valid:
            continue
        s = math.exp(sum(new[i, t].item() - old[i, t].item() for t in valid) / len(valid))
        a = advantages[i, valid[0]].item()
        losses.append(max(-a * s, -a * min(max(s, 1 - low), 1 + high)))
    return sum(losses) / len(losses)


def test_gspo_matches_a_loop_and_its_gradient_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.2, 0.4, 0.1]]))
    new = torch.log(torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, 0.1]])).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    advantages = torch.tensor([[1.0], [-2.0]]).expand(2, 3)
    out = ppo.gspo_policy_loss(old, new, advantages, mask, clip_low=0.2, clip_high=0.2)
    assert out.loss.item() == pytest.approx(gspo_loop(old, new.detach(), advantages, mask, 0.2, 0.2))
    out.loss.backward()
    # Row 0: s = sqrt(1.2) inside the clip range: d/dlogp_t = -A * s / |y| / rows.
    s = math.sqrt(0.6 / 0.5)
    assert new.grad[0, :2].tolist() == pytest.approx([-1.0 * s / 2 / 2] * 2)
    assert new.grad[0, 2].item() == 0.0
    # Row 1: ratio 1 exactly, A < 0: gradient +2 * 1 / 3 / 2 on each token.
    assert new.grad[1].tolist() == pytest.approx([2.0 / 3 / 2] * 3)


def test_gspo_clips_whole_sequences():
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[2.0, 2.0]])).requires_grad_()  # s = 2: far outside
    out = ppo.gspo_policy_loss(old, new, torch.ones(1, 2), torch.ones(1, 2), 3e-4, 4e-4)
    assert out.loss.item() == pytest.approx(-(1 + 4e-4)) and out.clipfrac.item() == 1.0
    out.loss.backward()
    assert new.grad.abs().sum().item() == 0.0  # clipped: no gradient, as PPO's clip


def test_reinforce_pp_matches_a_loop():
    rewards = torch.tensor([[0.0, -0.1, 1.0, 0.0], [0.0, 0.5, 0.0, -0.2]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]])
    gamma = 0.9
    advantages, returns = adv.reinforce_pp_advantages(rewards, mask, gamma)
    expected = torch.zeros_like(rewards)
    for b in range(2):
        running = 0.0
        for t in reversed(range(4)):
            if mask[b, t]:
                running = rewards[b, t].item() + gamma * running
                expected[b, t] = running
    assert torch.allclose(returns, expected, atol=1e-6)
    values = expected[mask > 0]
    whitened = (values - values.mean()) / torch.sqrt(values.var(unbiased=True) + 1e-8)
    assert torch.allclose(advantages[mask > 0], whitened, atol=1e-5)
    assert advantages[mask == 0].abs().sum() == 0


def test_reinforce_pp_baseline_by_hand():
    scores = torch.tensor([1.0, 0.0, 3.0, 5.0])
    groups = torch.tensor([0, 0, 1, 2])  # groups 1 and 2 are singletons: they keep their score
    assert adv.group_mean_baseline(scores, groups).tolist() == [0.5, -0.5, 3.0, 5.0]
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    out = adv.reinforce_pp_baseline_advantages(scores, groups, mask)
    tokens = torch.tensor([0.5, 0.5, -0.5, 3.0, 3.0, 5.0])
    whitened = (tokens - tokens.mean()) / torch.sqrt(tokens.var(unbiased=True) + 1e-8)
    assert torch.allclose(out[mask > 0], whitened, atol=1e-5)


def test_dynamic_sampling_drops_groups_whose_scores_are_all_equal():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.7])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 4])
    keep = dapo.groups_with_signal(scores, groups)
    # group 0 all right, group 2 all wrong, groups 3 and 4 singletons: only group 1 has signal
    assert keep.tolist() == [False, False, True, True, False, False, False, False]


def test_overlong_penalty_at_its_boundaries():
    lengths = torch.tensor([0, 12, 16, 18, 20])
    penalty = dapo.overlong_penalty(lengths, max_length=20, buffer=4, penalty_factor=1.5)
    assert penalty.tolist() == pytest.approx([0.0, 0.0, 0.0, -0.75, -1.5])
    with pytest.raises(ValueError):
        dapo.overlong_penalty(lengths, 20, 0)


def test_tis_weights_and_sequence_masks_on_known_values():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.9, 0.9, 0.9]]))
    rollout = torch.log(torch.tensor([[0.25, 0.5, 0.1], [0.9, 0.9, 0.9]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    weights = rollout_correction.tis_weights(old, rollout, mask, cap=2.0)
    assert weights.flatten().tolist() == pytest.approx([2.0, 1.0, 2.0, 1.0, 1.0, 0.0])  # 5 -> 2
    # Row 0: ratios 2, 1, 5 -> product 10, geometric mean 10^(1/3) = 2.154; row 1: 1.
    keep = rollout_correction.sequence_keep(old, rollout, mask, 0.5, 2.0, "geometric")
    assert keep.tolist() == [False, True]
    keep = rollout_correction.sequence_keep(old, rollout, mask, 0.1, 11.0, "sequence")
    assert keep.tolist() == [True, True]
    gap = rollout_correction.mismatch(old, rollout, mask)
    assert gap["rollout/logprob_diff_max"] == pytest.approx(math.log(5.0), abs=1e-6)
    assert gap["rollout/logprob_diff_mean"] == pytest.approx((math.log(2) + math.log(5)) / 5, abs=1e-6)


def test_sequence_tis_weights_equal_a_slow_loop():
    """verl's ``rollout_is=sequence``: each sequence's tokens weighted by its capped product of
    ratios; long sequences (whose product overflows float32) capped, not inf or NaN."""
    gen = torch.Generator().manual_seed(3)
    old = torch.randn(6, 40, generator=gen) - 2
    rollout = old + 0.05 * torch.randn(6, 40, generator=gen)
    rollout[5] -= 3.0  # ratio e^3 per token: e^120 over the row
    mask = (torch.rand(6, 40, generator=gen) > 0.2).float()
    mask[4] = 0.0  # an empty response
    for cap in (1.5, 2.0, 10.0):
        fast = rollout_correction.tis_weights(old, rollout, mask, cap, "sequence")
        for b in range(6):
            product = 1.0
            for t in range(40):
                if mask[b, t]:
                    product *= math.exp(float(old[b, t] - rollout[b, t]))
            weight = min(product, cap)
            for t in range(40):
                assert fast[b, t].item() == pytest.approx(weight if mask[b, t] else 0.0, rel=1e-5)
        assert torch.isfinite(fast).all() and fast[5].max().item() == pytest.approx(cap)
    with pytest.raises(ValueError, match="unknown TIS level"):
        rollout_correction.tis_weights(old, rollout, mask, 2.0, "geo")


def test_policy_loss_token_weights_scale_each_token():
    old, new = torch.zeros(1, 2), torch.zeros(1, 2)
    weights = torch.tensor([[2.0, 0.5]])
    out = ppo.policy_loss(old, new, torch.ones(1, 2), torch.ones(1, 2), token_weights=weights)
    assert out.loss.item() == pytest.approx(-(2.0 + 0.5) / 2)


# ---------------------------------------------------------------- against verl 0.9.1's own
# tests/verl_oracle.py calls verl's functions on the inputs below in verl's own environment
# (tools/oracle_env.sh: verl pins other transformers and tensordict releases than ours, so it
# never enters .venv); each test compares ours with what verl returned. float64 throughout, so
# a difference in the math shows far above rounding: TIGHT allows verl's 1e-8 guards in its
# masked means (x / (n + 1e-8)) and nothing more. Left out, as ours differs on purpose: GRPO and
# RLOO on a group of one (ours 0, verl the score itself), the overlong penalty (verl's sits inside
# its reward manager, no function to call).
TIGHT = {"rtol": 1e-7, "atol": 1e-9}
FLOAT32 = {"rtol": 1e-5, "atol": 1e-6}  # entropy: ours computes in float32 whatever comes in


def _verl_inputs(seed=11, rows=6, length=9):
    """One batch for every case: multi-turn holes in the mask, right padding, an empty row (4)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    mask = (torch.rand(rows, length, generator=gen) > 0.25).double()
    mask[0, :2], mask[1, 6:], mask[4] = 1.0, 0.0, 0.0
    old = -randn(rows, length).abs() - 0.5
    scores = randn(rows)
    outcome = torch.zeros(rows, length, dtype=torch.float64)
    outcome[torch.arange(rows), adv.last_token_index(mask)] = scores
    ref = old + 0.3 * randn(rows, length)
    ref[0, 0], ref[0, 1] = old[0, 0] + 30.0, old[0, 1] - 30.0  # beyond the KL estimators' clamps
    seq_advantages = randn(rows)
    # GSPO's sequence ratio outside its narrow clip range (rows 0, 2) or inside (1, 3, 5).
    shift = torch.tensor([1e-3, 1e-4, 2e-3, 0.0, 0.0, 5e-5], dtype=torch.float64)
    gspo_new = old + (seq_advantages.sign() * shift)[:, None] + 1e-4 * randn(rows, length)
    # log(pi_old / pi_rollout) per token about these, per row: each TIS cap and mask bound has
    # rows on both sides, far from the line.
    gap = torch.tensor([0.0, 0.3, -0.2, 0.06, 0.0, -0.05], dtype=torch.float64)
    return {"mask": mask, "old": old, "new": old + 0.7 * randn(rows, length), "ref": ref,
            "rollout": old - gap[:, None] - 0.02 * randn(rows, length),
            "advantages": randn(rows, length), "gspo_new": gspo_new,
            "seq_advantages": seq_advantages[:, None].expand(rows, length).contiguous(),
            "weights": 2.0 * torch.rand(rows, length, generator=gen, dtype=torch.float64),
            "rewards": randn(rows, length) * mask, "values": randn(rows, length),
            "vpreds": randn(rows, length), "returns": randn(rows, length),
            "scores": scores, "outcome": outcome,
            "logits": 3.0 * torch.randn(rows, length, 11, generator=gen)}


V = _verl_inputs()  # what both sides get
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])  # GRPO, RLOO: every group of two or more
BASELINE_GROUPS = torch.tensor([0, 0, 1, 1, 1, 2])  # REINFORCE++-baseline: a group of one too
VERL_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm")
VERL_KL = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
VANILLA = {"token-mean": (3.0, None), "seq-mean-token-mean": (3.0, "weights"),
           "seq-mean-token-sum": (10.0, None)}  # mode: (dual clip, token weights)
GSPO = {"seq-mean-token-mean": None, "token-mean": "weights"}
TIS_CAPS = {"token": 1.3, "sequence": 2.0}
# Bounds that keep some rows and not others, and would not if passed to verl unmapped (below).
MASK_LEVELS = {"geometric": ("seq_mean_k1", 0.97, 1.09), "sequence": ("seq_sum_k1", 0.8, 1.75)}
KL_UPDATES = [(0.5, 64), (0.01, 64), (0.1, 32), (10.0, 128)]
CASES = {
    **{f"agg/{mode}": ("agg_loss", dict(loss=V["advantages"], mask=V["mask"], mode=mode,
                                        horizon=16 if mode.endswith("norm") else None))
       for mode in VERL_AGG_MODES},
    "gae": ("gae", dict(rewards=V["rewards"], values=V["values"], mask=V["mask"], gamma=0.95,
                        lam=0.9)),
    **{f"grpo/{norm}": ("grpo", dict(rewards=V["outcome"], mask=V["mask"], index=GROUPS,
                                     norm_by_std=norm)) for norm in (True, False)},
    "rloo": ("rloo", dict(rewards=V["outcome"], mask=V["mask"], index=GROUPS)),
    "reinforce_pp": ("reinforce_pp", dict(rewards=V["rewards"], mask=V["mask"], gamma=0.9)),
    "reinforce_pp_baseline": ("reinforce_pp_baseline", dict(rewards=V["outcome"], mask=V["mask"],
                                                            index=BASELINE_GROUPS)),
    **{f"kl/{kind}": ("kl_penalty", dict(logprob=V["old"], ref_logprob=V["ref"], kind=kind))
       for kind in VERL_KL},
    **{f"vanilla/{mode}": ("policy_loss", dict(
        name="vanilla", old_logprob=V["old"], logprob=V["new"], advantages=V["advantages"],
        mask=V["mask"], agg_mode=mode, clip_low=0.2, clip_high=0.28, clip_ratio_c=dual,
        weights=V[weights] if weights else None)) for mode, (dual, weights) in VANILLA.items()},
    **{f"gspo/{mode}": ("policy_loss", dict(
        name="gspo", old_logprob=V["old"], logprob=V["gspo_new"], advantages=V["seq_advantages"],
        mask=V["mask"], agg_mode=mode, clip_low=3e-4, clip_high=4e-4,
        weights=V[weights] if weights else None)) for mode, weights in GSPO.items()},
    **{f"value/{mode}": ("value_loss", dict(vpreds=V["vpreds"], returns=V["returns"],
                                            values=V["values"], mask=V["mask"],
                                            cliprange_value=0.5, agg_mode=mode))
       for mode in ("token-mean", "seq-mean-token-mean")},
    "entropy": ("entropy", dict(logits=V["logits"], mask=V["mask"].float(), agg_mode="token-mean")),
    "adaptive_kl": ("adaptive_kl", dict(init_kl_coef=0.2, target=0.1, horizon=1000,
                                        updates=KL_UPDATES)),
    **{f"tis/{level}": ("is_weights", dict(old_logprob=V["old"], rollout_logprob=V["rollout"],
                                           mask=V["mask"], level=level, cap=cap))
       for level, cap in TIS_CAPS.items()},
    # verl's *_k1 statistic is log(pi_rollout / pi_old), ours log(pi_old / pi_rollout): our
    # [low, high] is verl's "1/high_1/low" (the same for the symmetric defaults, 0.5 and 2).
    **{f"mask/{level}": ("rejection_mask", dict(
        old_logprob=V["old"], rollout_logprob=V["rollout"], mask=V["mask"], option=option,
        threshold=f"{1 / high!r}_{1 / low!r}"))
       for level, (option, low, high) in MASK_LEVELS.items()},
}


@pytest.fixture(scope="module")
def verl(tmp_path_factory):
    """What verl 0.9.1 returns for each of :data:`CASES`: ``{name: result}``."""
    return run_verl(CASES, tmp_path_factory.mktemp("verl_oracle"))


def run_verl(cases: dict, folder: Path) -> dict:
    """What verl 0.9.1 returns for each of ``cases`` (``{name: (function, kwargs)}``, see
    tests/verl_oracle.py): ``{name: result}``. Builds the oracle environment first
    (tools/oracle_env.sh: a few minutes once; then nothing to do)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    try:
        build = subprocess.run(["bash", str(ROOT / "tools" / "oracle_env.sh")], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=1500)
    except subprocess.TimeoutExpired:
        missing("the verl 0.9.1 oracle environment (tools/oracle_env.sh): no build in 1500 s")
    if build.returncode != 0:
        reason = (build.stderr.strip().splitlines() or [f"exit {build.returncode}"])[-1]
        missing(f"the verl 0.9.1 oracle environment (tools/oracle_env.sh): {reason}")
    torch.save(cases, folder / "cases.pt")
    run = subprocess.run([str(ROOT / ".venv-oracle" / "bin" / "python"), "tests/verl_oracle.py",
                          str(folder / "cases.pt"), str(folder / "results.pt")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"tests/verl_oracle.py failed:\n{run.stderr[-4000:]}"
    return torch.load(folder / "results.pt")


def close(ours, theirs, tolerance=TIGHT):
    torch.testing.assert_close(torch.as_tensor(ours, dtype=torch.float64),
                               torch.as_tensor(theirs, dtype=torch.float64), **tolerance)


@pytest.mark.parametrize("mode", VERL_AGG_MODES)
def test_loss_aggregation_matches_verl(verl, mode):
    # verl's seq-mean-token-sum-norm takes the horizon as loss_scale_factor.
    close(ppo.aggregate(V["advantages"], V["mask"], mode, horizon=16), verl[f"agg/{mode}"])


def test_advantage_estimators_match_verl(verl):
    mask = V["mask"]
    # verl always whitens GAE's advantages (ours: algorithm.whiten_advantages); it also leaves
    # values on masked positions, which nothing reads: both compared on the mask.
    advantages, returns = adv.compute_gae(V["rewards"], V["values"], mask, 0.95, 0.9)
    close(adv.masked_whiten(advantages, mask), verl["gae"][0] * mask)
    close(returns, verl["gae"][1] * mask)
    for norm in (True, False):
        ours = adv.group_normalized_advantages(V["scores"], GROUPS, norm_by_std=norm)
        close(ours[:, None] * mask, verl[f"grpo/{norm}"])
    close(adv.rloo_advantages(V["scores"], GROUPS)[:, None] * mask, verl["rloo"])
    advantages, returns = adv.reinforce_pp_advantages(V["rewards"], mask, 0.9)
    close(advantages, verl["reinforce_pp"][0])
    close(returns, verl["reinforce_pp"][1])
    close(adv.reinforce_pp_baseline_advantages(V["scores"], BASELINE_GROUPS, mask),
          verl["reinforce_pp_baseline"])


@pytest.mark.parametrize("kind", VERL_KL)
def test_kl_estimators_match_verl(verl, kind):
    ours = ppo.kl_estimate(V["old"], V["ref"], {"kl": "k1"}.get(kind, kind))
    close(ours, verl[f"kl/{kind}"])


def _check_policy_loss(out, new, theirs):
    close(out.loss, theirs["loss"])
    out.loss.backward()
    close(new.grad, theirs["grad"])
    close(out.clipfrac, theirs["actor/pg_clipfrac"])
    close(out.approx_kl, theirs["actor/ppo_kl"])
    close(out.dual_clipfrac, theirs["actor/pg_clipfrac_lower"])


@pytest.mark.parametrize("mode", VANILLA)
def test_ppo_policy_loss_and_its_gradient_match_verl(verl, mode):
    dual, weights = VANILLA[mode]
    new = V["new"].clone().requires_grad_()
    out = ppo.policy_loss(V["old"], new, V["advantages"], V["mask"], 0.2, 0.28, dual, mode,
                          V[weights] if weights else None)
    theirs = verl[f"vanilla/{mode}"]
    assert 0 < theirs["actor/pg_clipfrac"] < 1
    assert theirs["actor/pg_clipfrac_lower"] > 0 or dual > 3.0  # the dual clip bound is met
    _check_policy_loss(out, new, theirs)


@pytest.mark.parametrize("mode", GSPO)
def test_gspo_loss_and_its_gradient_match_verl(verl, mode):
    new = V["gspo_new"].clone().requires_grad_()
    weights = V[GSPO[mode]] if GSPO[mode] else None
    out = ppo.gspo_policy_loss(V["old"], new, V["seq_advantages"], V["mask"], 3e-4, 4e-4, mode,
                               weights)
    theirs = verl[f"gspo/{mode}"]
    assert 0 < theirs["actor/pg_clipfrac"] < 1  # some sequences clipped, some not
    _check_policy_loss(out, new, theirs)


def test_value_loss_entropy_and_kl_controller_match_verl(verl):
    for mode in ("token-mean", "seq-mean-token-mean"):
        loss, clipfrac = ppo.value_loss(V["vpreds"], V["values"], V["returns"], V["mask"], 0.5,
                                        mode)
        close(loss, verl[f"value/{mode}"][0])
        close(clipfrac, verl[f"value/{mode}"][1])
    per_token = ppo.entropy_from_logits(V["logits"])
    close(per_token, verl["entropy"]["per_token"], FLOAT32)
    close(ppo.aggregate(per_token, V["mask"].float(), "token-mean"), verl["entropy"]["loss"],
          FLOAT32)
    controller = ppo.AdaptiveKLController(0.2, 0.1, 1000)
    for (current_kl, n_steps), theirs in zip(KL_UPDATES, verl["adaptive_kl"], strict=True):
        controller.update(current_kl, n_steps)
        close(controller.value, theirs)


def test_rollout_correction_matches_verl(verl):
    mask = V["mask"]
    for level, cap in TIS_CAPS.items():
        ours = rollout_correction.tis_weights(V["old"], V["rollout"], mask, cap, level)
        close(ours, verl[f"tis/{level}"])
        assert (ours[mask > 0] == cap).any() and (ours[mask > 0] < cap).any()  # capped and not
    for level, (_, low, high) in MASK_LEVELS.items():
        ours = rollout_correction.sequence_keep(V["old"], V["rollout"], mask, low, high, level)
        theirs = (verl[f"mask/{level}"] == mask).all(dim=1)  # verl: the mask, rejected rows zeroed
        assert ours.tolist() == theirs.tolist() and 1 < int(ours.sum()) < len(ours)


# ---------------------------------------------------------------- dynamic sampling's rounds
class _FakeRun:
    """What :func:`rollout_with_signal` uses of a PPO run. Prompt ``i`` is "solved" by a fixed
    pattern: prompts divisible by 3 by every sample, by 3 plus 1 by none, the rest by half."""

    def __init__(self, train_batch_size=4, max_rounds=4, prompts=40):
        from megatron_rlhf.config.ppo_schema import PPOConfig
        from megatron_rlhf.data.prompts import Prompt
        from megatron_rlhf.trainers.rl.agent import PPORun

        self.cfg = PPOConfig()
        self.cfg.data.train_batch_size = train_batch_size
        self.cfg.rollout.n = 2
        self.cfg.algorithm.filter_groups.enable = True
        self.cfg.algorithm.filter_groups.max_rounds = max_rounds
        self.train = [Prompt((5, i), str(i)) for i in range(prompts)]
        self.steps_per_epoch, self.pad_id, self.logs, self.generated = 1, 0, [], []
        self.step_indices = lambda step: PPORun.step_indices(self, step)
        self.extra_indices = lambda *a: PPORun.extra_indices(self, *a)

    def sampling(self, step):
        from megatron_rlhf.rollout.base import SamplingParams

        return SamplingParams(max_tokens=4, n=2, seed=step)

    def generate(self, prompts, params):
        from megatron_rlhf.rollout.base import Generation

        self.generated.append([p.ids[1] for p in prompts])
        return [Generation(i, [7, 8], [-0.5, -0.5], True) for i in range(len(prompts))
                for _ in range(2)]

    def scores(self, prompts, gens, batch):
        def solved(i, sample):
            number = prompts[i].ids[1]
            return 1.0 if number % 3 == 0 else 0.0 if number % 3 == 1 else float(sample)

        score = torch.tensor([solved(g.prompt_index, row % 2) for row, g in enumerate(gens)])
        return {"score": score, "rm": None, "turns": None, "oracle": score.clone()}

    def log(self, message):
        self.logs.append(message)


def _timer():
    from megatron_rlhf.trainers.rl.agent import Timer

    return Timer()


def test_dynamic_sampling_rounds_until_the_batch_has_signal():
    from megatron_rlhf.trainers.rl.dynamic_sampling import rollout_with_signal

    run = _FakeRun(train_batch_size=4)
    prompts, gens, batch, scored, metrics = rollout_with_signal(run, 0, _timer())
    first = run.generated[0]
    with_signal = [n for n in first if n % 3 == 2]
    assert metrics["dapo/rounds"] == len(run.generated) > 1
    assert metrics["dapo/dropped_groups"] + metrics["dapo/kept_groups"] == sum(map(len, run.generated))
    assert metrics["dapo/kept_groups"] >= 4 and metrics["dapo/trained_groups"] == 4
    # Every trained group has signal; later rounds draw prompts the step had not used.
    assert all(p.ids[1] % 3 == 2 for p in prompts) and len(prompts) == 4
    assert [p.ids[1] for p in prompts[:len(with_signal)]] == with_signal[:4]
    seen = [n for round_ in run.generated for n in round_]
    assert len(seen) == len(set(seen))
    assert batch["train_rows"].all() and batch["input_ids"].shape[0] == len(gens) == 8
    assert scored["score"].shape == (8,) and all(g.prompt_index == i // 2 for i, g in enumerate(gens))
    # The same step draws the same extra prompts again (a resumed run repeats itself).
    again = _FakeRun(train_batch_size=4)
    rollout_with_signal(again, 0, _timer())
    assert again.generated == run.generated


def test_dynamic_sampling_trains_on_what_it_has_when_rounds_run_out():
    from megatron_rlhf.trainers.rl.dynamic_sampling import rollout_with_signal

    run = _FakeRun(train_batch_size=6, max_rounds=1)
    prompts, gens, batch, scored, metrics = rollout_with_signal(run, 0, _timer())
    kept = metrics["dapo/kept_groups"]
    assert metrics["dapo/rounds"] == 1 and kept < 6 and len(prompts) == 6
    # The batch keeps its size; the groups without signal are there but out of the loss.
    assert batch["train_rows"].tolist() == [True] * (2 * kept) + [False] * (2 * (6 - kept))
    assert run.logs and "groups had signal after 1 rounds" in run.logs[0]
