"""The rollout-correction toolbox (``algorithm.rollout_correction``, issue 34 item 4) against
verl 0.9.1's own ``rollout_corr_helper`` and bypass losses, which tests/verl_oracle.py runs in
their own environment (see tests/test_recipes.py): IS weights (TIS, IcePop, batch normalisation)
at token and sequence level, every rejection option, the whole decoupled correction with its
metrics, the bypass losses with their gradients. On two batches: test_recipes' (multi-turn holes,
an empty response) and an edge batch (inf, -inf and NaN log-probs at masked positions, an
all-masked response holding NaN, a one-token response).

By hand instead, where verl has nothing or differs on purpose: the ``geometric`` IS level (not in
verl 0.9.1); token weights where a masked position holds NaN (verl's are NaN there, ours 0: the
comparison takes verl's everywhere else); ``mismatch/ppl_ratio``, which averages over non-empty
responses (verl counts an empty one as ratio 1: compared after undoing that); the bypass REINFORCE
update equal to PPO's when the engine equals the trainer; the config checks and the trainer glue.
"""

import math
import re
from types import SimpleNamespace

import pytest
import torch

from megatron_rlhf.algorithms import ppo
from megatron_rlhf.algorithms import rollout_correction as rc
from megatron_rlhf.algorithms.policy_losses import POLICY_LOSS_REGISTRY
from tests.test_recipes import TIGHT, V, close, run_verl


def _edge_inputs():
    """Masked positions holding inf, -inf and NaN log-probs; response 1 has one token, response 2
    none (its log-probs NaN); response 3 has holes; response 4 the largest mismatch."""
    gen = torch.Generator().manual_seed(5)
    old = -torch.rand(5, 6, generator=gen, dtype=torch.float64) - 0.5
    rollout = old - 0.12 * torch.randn(5, 6, generator=gen, dtype=torch.float64)
    mask = torch.ones(5, 6, dtype=torch.float64)
    mask[0, 4:], mask[1, 1:], mask[2], mask[3, 2], mask[3, 5] = 0.0, 0.0, 0.0, 0.0, 0.0
    rollout[0, 4], old[0, 5], old[1, 3], rollout[1, 4] = -math.inf, -math.inf, math.nan, math.inf
    old[2], rollout[3, 2] = math.nan, math.nan
    return {"old": old, "rollout": rollout, "mask": mask}


BATCHES = {"v": {k: V[k] for k in ("old", "rollout", "mask")}, "edge": _edge_inputs()}
# IS: level, cap, IcePop's low (0: TIS), batch normalisation. Each caps or zeroes some weights
# of both batches and leaves others.
IS = {"token/tis": ("token", 1.1, 0.0, False), "sequence/tis": ("sequence", 1.2, 0.0, False),
      "token/icepop": ("token", 1.2, 0.9, False), "sequence/icepop": ("sequence", 1.6, 0.6, False),
      "token/tis/norm": ("token", 1.1, 0.0, True), "sequence/tis/norm": ("sequence", 1.2, 0.0, True),
      "token/icepop/norm": ("token", 1.2, 0.9, True),
      "sequence/icepop/norm": ("sequence", 1.6, 0.6, True)}
# Rejection: our (low, high) ratio band for k1, the largest statistic for k2/k3 (nats). Each
# option keeps some and rejects some of test_recipes' batch.
RS = {"token_k1": (0.9, 1.25), "token_k2": 0.01, "token_k3": 0.01,
      "seq_sum_k1": (0.8, 1.75), "seq_sum_k2": 0.015, "seq_sum_k3": 0.015,
      "seq_mean_k1": (0.97, 1.09), "seq_mean_k2": 0.01, "seq_mean_k3": 0.01,
      "seq_max_k2": 0.005, "seq_max_k3": 0.005}
# The whole correction: (IS level or None, cap, low, normalise, rejection option or None).
PIPELINES = {"token_tis+token_k3": ("token", 1.1, 0.0, False, "token_k3"),
             "seq_icepop_norm+seq_mean_k1": ("sequence", 1.6, 0.6, True, "seq_mean_k1"),
             "token_icepop_norm+seq_max_k2": ("token", 1.2, 0.9, True, "seq_max_k2"),
             "seq_sum_k1": (None, 2.0, 0.0, False, "seq_sum_k1")}
BYPASS_AGG = ("token-mean", "seq-mean-token-sum")


def _verl_is_threshold(cap, low):
    return f"{low!r}_{cap!r}" if low > 0 else cap


def _verl_rs_threshold(option):
    """Ours bounds r = pi_old / pi_rollout, verl's k1 bounds 1 / r: the band flips."""
    bound = RS[option]
    return f"{1 / bound[1]!r}_{1 / bound[0]!r}" if option.endswith("k1") else bound


def _settings(level, cap, low, normalize, option):
    mode = "+".join(m for m, on in (("tis", level), ("mask", option)) if on)
    band = RS[option] if option and option.endswith("k1") else (0.5, 2.0)
    return SimpleNamespace(mode=mode, tis_level=level or "token", tis_cap=cap, tis_low=low,
                           tis_batch_normalize=normalize, mask_level=option or "geometric",
                           mask_low=band[0], mask_high=band[1],
                           mask_divergence_max=0.01 if not option or option.endswith("k1")
                           else RS[option])


CASES = {
    **{f"is/{b}/{name}": ("is_weights", dict(
        old_logprob=x["old"], rollout_logprob=x["rollout"], mask=x["mask"], level=level,
        cap=_verl_is_threshold(cap, low), batch_normalize=norm))
       for b, x in BATCHES.items() for name, (level, cap, low, norm) in IS.items()},
    **{f"rs/{b}/{option}": ("rejection_mask", dict(
        old_logprob=x["old"], rollout_logprob=x["rollout"], mask=x["mask"], option=option,
        threshold=_verl_rs_threshold(option))) for b, x in BATCHES.items() for option in RS},
    **{f"pipeline/{b}/{name}": ("correction", dict(
        old_logprob=x["old"], rollout_logprob=x["rollout"], mask=x["mask"], rollout_is=level,
        is_threshold=_verl_is_threshold(cap, low), batch_normalize=norm, rollout_rs=option,
        rs_threshold=_verl_rs_threshold(option) if option else None))
       for b, x in BATCHES.items() for name, (level, cap, low, norm, option) in PIPELINES.items()},
    # Without the empty response, verl's perplexity ratio is ours as it stands.
    "offpolicy/nonempty": ("offpolicy_metrics", dict(
        old_logprob=V["old"][[0, 1, 2, 3, 5]], rollout_logprob=V["rollout"][[0, 1, 2, 3, 5]],
        mask=V["mask"][[0, 1, 2, 3, 5]])),
    **{f"bypass/{loss}/{agg}": ("bypass_loss", dict(
        loss_type=loss, rollout_logprob=V["old"], logprob=V["new"], advantages=V["advantages"],
        mask=V["mask"], agg_mode=agg, clip_low=0.2, clip_high=0.28))
       for loss in ("ppo_clip", "reinforce") for agg in BYPASS_AGG},
    "reinforce/weights": ("reinforce_loss", dict(
        rollout_logprob=V["old"], logprob=V["new"], advantages=V["advantages"], mask=V["mask"],
        agg_mode="token-mean", weights=V["weights"])),
}


@pytest.fixture(scope="module")
def verl(tmp_path_factory):
    return run_verl(CASES, tmp_path_factory.mktemp("verl_mismatch"))


def close_where_defined(ours, theirs, mask):
    """verl's value wherever it is a number; where it is NaN (token weights at a masked position
    holding NaN) ours is 0, as every masked position."""
    defined = ~torch.isnan(theirs)
    close(ours[defined], theirs[defined])
    assert (ours[~defined] == 0).all() and (mask[~defined] == 0).all()


# ------------------------------------------------------------------ against verl 0.9.1
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("name", IS)
def test_is_weights_match_verl(verl, batch, name):
    x, (level, cap, low, norm) = BATCHES[batch], IS[name]
    ours = rc.tis_weights(x["old"], x["rollout"], x["mask"], cap, level, low, norm)
    close_where_defined(ours, verl[f"is/{batch}/{name}"], x["mask"])
    assert torch.isfinite(ours).all() and (ours[x["mask"] == 0] == 0).all()
    if not norm:  # the cap or the band acts on some weights and not others
        raw = rc.raw_is_weights(x["old"], x["rollout"], x["mask"], level)[x["mask"] > 0]
        acted = ((raw > cap) | (raw < low)) if low else raw > cap
        assert acted.any() and not acted.all()


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("option", RS)
def test_rejection_matches_verl(verl, batch, option):
    x = BATCHES[batch]
    bound = RS[option]
    low, high = bound if option.endswith("k1") else (0.5, 2.0)
    keep = rc.rejection_keep(x["old"], x["rollout"], x["mask"], option, low, high,
                             bound if not option.endswith("k1") else 0.01)
    kept = x["mask"] * keep
    close(kept, verl[f"rs/{batch}/{option}"])
    if option.startswith("seq_"):  # a whole sample or nothing
        assert ((kept == x["mask"]).all(dim=1) | (kept == 0).all(dim=1)).all()
    if batch == "v":
        assert 0 < kept.sum() < x["mask"].sum()
    # The empty response (or the all-NaN one) is kept: its statistic is 0.
    empty = 4 if batch == "v" else 2
    assert keep[empty].all()


VERL_METRICS = {"mismatch/kl_k1": "kl", "mismatch/kl_k3": "k3_kl", "is/weight_mean": "rollout_is_mean",
                "is/batch_norm_factor": "rollout_is_batch_norm_factor",
                "rs/rejected_fraction": "rollout_rs_masked_fraction"}


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("name", PIPELINES)
def test_whole_correction_and_its_metrics_match_verl(verl, batch, name):
    x, (level, cap, low, norm, option) = BATCHES[batch], PIPELINES[name]
    theirs = verl[f"pipeline/{batch}/{name}"]
    out = rc.correct(x["old"], x["rollout"], x["mask"], _settings(level, cap, low, norm, option))
    if level:
        close_where_defined(out.weights, theirs["weights"], x["mask"])
    else:
        assert out.weights is None and theirs["weights"] is None
    keep = out.tokens if out.tokens is not None else out.rows[:, None].expand_as(x["mask"])
    close(x["mask"] * keep, theirs["mask"])
    m = theirs["metrics"]
    for ours_key, verl_key in VERL_METRICS.items():
        assert (ours_key in out.metrics) == (verl_key in m), ours_key
        if verl_key in m:
            close(out.metrics[ours_key], m[verl_key])
    if level:  # the logged weights are those before the batch normalisation, as verl's
        assert out.metrics["rollout/is_weight_mean"] == pytest.approx(out.metrics["is/weight_mean"])
    if level == "token":  # verl's token-level max and fractions are over tokens, as ours
        close(out.metrics["is/weight_max"], m["rollout_is_max"])
        close(out.metrics["is/capped_fraction"], 0.0 if low else m["rollout_is_ratio_fraction_high"])
    if low:
        close(out.metrics["is/zeroed_fraction"], m["rollout_is_oob_ratio"])
        assert out.metrics["is/capped_fraction"] == 0.0
    # verl's perplexity ratio counts each empty response as 1; ours leaves them out.
    rows, nonempty = x["mask"].shape[0], int((x["mask"].sum(1) > 0).sum())
    close(out.metrics["mismatch/ppl_ratio"], (m["ppl_ratio"] * rows - (rows - nonempty)) / nonempty)
    assert all(math.isfinite(v) for v in out.metrics.values())


def test_mismatch_metrics_match_verl_without_empty_responses(verl):
    rows = [0, 1, 2, 3, 5]
    ours = rc.mismatch_metrics(V["old"][rows], V["rollout"][rows], V["mask"][rows])
    theirs = verl["offpolicy/nonempty"]
    for key, verl_key in (("kl_k1", "kl"), ("kl_k3", "k3_kl"), ("ppl_ratio", "ppl_ratio")):
        close(ours[f"mismatch/{key}"], theirs[verl_key])
    close(ours["mismatch/logprob_diff_mean"],
          ((V["old"] - V["rollout"]).abs() * V["mask"]).sum() / V["mask"].sum())


@pytest.mark.parametrize("agg", BYPASS_AGG)
@pytest.mark.parametrize("loss", ("ppo_clip", "reinforce"))
def test_bypass_losses_and_their_gradients_match_verl(verl, loss, agg):
    """Bypass: the old log-probs are the engine's; ppo_clip is the PPO loss against them,
    reinforce verl's ``-A * log pi``."""
    new = V["new"].clone().requires_grad_()
    name = "vanilla" if loss == "ppo_clip" else "reinforce"
    out = POLICY_LOSS_REGISTRY[name].compute(V["old"], new, V["advantages"], V["mask"],
                                             SimpleNamespace(clip_ratio_c=3.0), (0.2, 0.28), agg,
                                             None, None)
    theirs = verl[f"bypass/{loss}/{agg}"]
    close(out.loss, theirs["loss"])
    out.loss.backward()
    close(new.grad, theirs["grad"])
    close(out.approx_kl, theirs["actor/ppo_kl"])
    if loss == "ppo_clip":
        close(out.clipfrac, theirs["actor/pg_clipfrac"])
        close(out.dual_clipfrac, theirs["actor/pg_clipfrac_lower"])


def test_reinforce_with_importance_weights_matches_verl(verl):
    new = V["new"].clone().requires_grad_()
    out = ppo.reinforce_policy_loss(V["old"], new, V["advantages"], V["mask"], "token-mean",
                                    V["weights"])
    theirs = verl["reinforce/weights"]
    close(out.loss, theirs["loss"])
    out.loss.backward()
    close(new.grad, theirs["grad"])
    close(out.approx_kl, theirs["actor/ppo_kl"])


# ------------------------------------------------------------------ by hand
def _loop_weight(old, rollout, mask, row, level):
    valid = [t for t in range(mask.shape[1]) if mask[row, t]]
    logs = [float(old[row, t] - rollout[row, t]) for t in valid]
    if not logs:
        return 0.0
    total = sum(logs) / (len(logs) if level == "geometric" else 1)
    return math.exp(max(-20.0, min(20.0, total)))


@pytest.mark.parametrize("batch", BATCHES)
def test_geometric_weights_equal_a_slow_loop(batch):
    """Not in verl 0.9.1: each token weighted by its sequence's geometric mean ratio, capped
    (TIS) or zeroed outside the band (IcePop); the same on every token of the sequence."""
    x = BATCHES[batch]
    old, rollout, mask = x["old"], x["rollout"], x["mask"]
    for cap, low in ((1.05, 0.0), (1.2, 0.9)):
        ours = rc.tis_weights(old, rollout, mask, cap, "geometric", low)
        for b in range(mask.shape[0]):
            w = _loop_weight(old, rollout, mask, b, "geometric")
            w = (w if low <= w <= cap else 0.0) if low else min(w, cap)
            for t in range(mask.shape[1]):
                assert ours[b, t].item() == pytest.approx(w if mask[b, t] else 0.0, rel=1e-12)
    normalized = rc.tis_weights(old, rollout, mask, 1.05, "geometric", batch_normalize=True)
    rows = mask.sum(1) > 0
    per_row = (normalized * mask).sum(1)[rows] / mask.sum(1)[rows]
    assert per_row.mean().item() == pytest.approx(1.0, rel=1e-12)  # one weight per sample


def test_batch_normalisation_averages_one_and_keeps_zeros():
    x = BATCHES["edge"]
    mask = x["mask"]
    for level in ("token", "sequence"):
        raw = rc.tis_weights(x["old"], x["rollout"], mask, 1.2, level, 0.9)
        weights, factor = rc.normalize_is_weights(raw, mask, level)
        if level == "token":
            assert ((weights * mask).sum() / mask.sum()).item() == pytest.approx(1.0, rel=1e-12)
        else:
            rows = mask.sum(1) > 0
            assert ((weights * mask).sum(1)[rows] / mask.sum(1)[rows]).mean().item() == \
                pytest.approx(1.0, rel=1e-12)
        assert torch.equal(weights == 0, raw == 0) and factor > 0  # IcePop's zeros stay zero
    nothing = torch.zeros_like(mask)
    assert rc.normalize_is_weights(nothing, mask)[1] == 1.0  # nothing to divide by


def test_token_weights_are_zero_where_masked_positions_hold_nan_or_inf():
    """verl's token weights are NaN where a masked position holds NaN; ours are 0 there, and the
    empty and the one-token responses are what a hand computes."""
    x = BATCHES["edge"]
    old, rollout, mask = x["old"], x["rollout"], x["mask"]
    for level in rc.TIS_LEVELS:
        weights = rc.tis_weights(old, rollout, mask, 1.1, level)
        assert torch.isfinite(weights).all() and (weights[mask == 0] == 0).all()
        assert (weights[2] == 0).all()  # the all-masked response
        assert weights[1, 0].item() == pytest.approx(min(math.exp(float(old[1, 0] - rollout[1, 0])), 1.1))
    out = rc.correct(old, rollout, mask, _settings("token", 1.1, 0.0, False, "token_k1"))
    assert all(math.isfinite(v) for v in out.metrics.values())


def test_ppl_ratio_leaves_out_empty_responses():
    old = torch.log(torch.tensor([[0.5, 0.5], [0.2, 0.2], [0.3, 0.3]]))
    rollout = torch.log(torch.tensor([[0.25, 0.25], [0.2, 0.2], [0.3, 0.3]]))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    out = rc.mismatch_metrics(old, rollout, mask)
    # Perplexity ratio trainer / engine: 1/2 for the first response, 1 for the second.
    assert out["mismatch/ppl_ratio"] == pytest.approx((0.5 + 1.0) / 2)
    assert out["mismatch/kl_k1"] == pytest.approx(-math.log(2) * 2 / 3)
    assert out["mismatch/kl_k3"] == pytest.approx((2 - 1 - math.log(2)) * 2 / 3)
    assert out["mismatch/logprob_diff_mean"] == pytest.approx(math.log(2) * 2 / 3)


def test_the_old_mask_levels_are_verls_k1_sequence_options():
    x = BATCHES["v"]
    for level, option in rc.MASK_ALIASES.items():
        ours = rc.sequence_keep(x["old"], x["rollout"], x["mask"], 0.9, 1.3, level)
        theirs = rc.rejection_keep(x["old"], x["rollout"], x["mask"], option, 0.9, 1.3)
        assert ours.tolist() == theirs.all(dim=1).tolist()
    with pytest.raises(ValueError, match="unknown rejection option"):
        rc.rejection_keep(x["old"], x["rollout"], x["mask"], "seq_max_k1")


@pytest.mark.parametrize("agg", ppo.AGG_MODES)
def test_bypass_reinforce_updates_as_ppo_when_the_engine_equals_the_trainer(agg):
    """The engine's log-probs are the trainer's (old = rollout = current): REINFORCE's gradient
    ``-A grad log pi`` is PPO's at ratio 1, so one optimizer step moves the policy the same;
    only the loss value differs (``-A log pi`` against ``-A``)."""
    gen = torch.Generator().manual_seed(2)
    logprob = -torch.rand(4, 5, generator=gen, dtype=torch.float64) - 0.1
    advantages = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    mask = (torch.rand(4, 5, generator=gen) > 0.3).double()
    grads = {}
    for name in ("vanilla", "reinforce"):
        new = logprob.clone().requires_grad_()
        out = POLICY_LOSS_REGISTRY[name].compute(logprob, new, advantages, mask,
                                                 SimpleNamespace(clip_ratio_c=3.0), (0.2, 0.2),
                                                 agg, None, 5)
        out.loss.backward()
        grads[name] = new.grad
        assert out.approx_kl.item() == 0.0 and out.clipfrac.item() == 0.0
    torch.testing.assert_close(grads["reinforce"], grads["vanilla"], rtol=0, atol=1e-15)
    assert grads["vanilla"].abs().sum() > 0


# ------------------------------------------------------------------ config and trainer glue
def _config(*overrides):
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_schema import PPOConfig

    base = ["actor.model_path=x", "data.train_files=[a.parquet]", "reward.fn=addition"]
    return load_config(PPOConfig, None, base + list(overrides))


def test_bypass_reinforce_sets_the_policy_loss_once():
    from megatron_rlhf.config.ppo_checks import reuses_update_log_probs, validate_ppo_config

    cfg = validate_ppo_config(_config("algorithm.rollout_correction.bypass=true",
                                      "algorithm.rollout_correction.bypass_loss=reinforce"))
    assert cfg.actor.policy_loss == "reinforce" and not reuses_update_log_probs(cfg)
    assert validate_ppo_config(cfg).actor.policy_loss == "reinforce"  # validated again: the same
    plain = validate_ppo_config(_config("algorithm.rollout_correction.bypass=true"))
    assert plain.actor.policy_loss == "vanilla"


C = "algorithm.rollout_correction."


@pytest.mark.parametrize("overrides, message", [
    ([f"{C}mode=mask", f"{C}mask_level=token_k4"], f"{C}mask_level='token_k4' must be one of"),
    ([f"{C}mode=mask", f"{C}mask_level=seq_max_k1"], "use seq_max_k2 or seq_max_k3"),
    ([f"{C}mode=tis", f"{C}tis_level=geo"], f"{C}tis_level='geo' must be one of"),
    ([f"{C}bypass=true", f"{C}bypass_loss=pg"], f"{C}bypass_loss='pg' must be one of"),
    ([f"{C}mode=tis", f"{C}tis_cap=0"], f"{C}tis_cap=0.0 must be > 0"),
    ([f"{C}mode=tis", f"{C}tis_low=1.5"], f"{C}tis_low=1.5 must be in [0, 1)"),
    ([f"{C}mode=tis", f"{C}tis_low=0.5", f"{C}tis_cap=0.4"], f"{C}tis_low=0.5 must be below tis_cap=0.4"),
    ([f"{C}mode=mask", f"{C}mask_low=3", f"{C}mask_high=2"], "0 < mask_low < 1 < mask_high"),
    ([f"{C}mode=mask", f"{C}mask_level=seq_mean_k3", f"{C}mask_divergence_max=0"],
     f"{C}mask_divergence_max=0.0 must be > 0"),
    ([f"{C}bypass_loss=reinforce"], "set algorithm.rollout_correction.bypass=true"),
    ([f"{C}bypass=true", f"{C}bypass_loss=reinforce", "actor.policy_loss=gspo"],
     "leave it at vanilla (got gspo)"),
    (["actor.policy_loss=reinforce"], "actor.policy_loss=reinforce is set by"),
])
def test_bad_rollout_correction_settings_are_one_clear_line(overrides, message):
    from megatron_rlhf.config.ppo_checks import validate_ppo_config
    from megatron_rlhf.errors import UserError

    with pytest.raises(UserError, match=re.escape(message)) as err:
        validate_ppo_config(_config(*overrides))
    assert "\n" not in str(err.value)


def _trainer_step(option, mode="mask"):
    """PPORun.correct and leave_out_untrained on test_recipes' batch, without a model."""
    from megatron_rlhf.config.ppo_schema import PPOConfig
    from megatron_rlhf.trainers.rl.agent import PPORun

    cfg = PPOConfig()
    c = cfg.algorithm.rollout_correction
    c.mode, c.mask_level, c.mask_low, c.mask_high = mode, option, 0.9, 1.25
    c.tis_cap = 1.1
    run = SimpleNamespace(cfg=cfg)
    mask = V["mask"].float()
    batch = {"loss_mask": mask.clone()}
    metrics = PPORun.correct(run, batch, V["old"].float(), V["rollout"].float())
    rows = mask.shape[0]
    PPORun.leave_out_untrained(run, [SimpleNamespace(finished=True)] * rows, batch)
    return mask, batch, metrics


def test_token_rejection_narrows_the_loss_mask_and_keeps_every_response():
    mask, batch, metrics = _trainer_step("token_k1", mode="tis+mask")
    keep = rc.rejection_keep(V["old"].float(), V["rollout"].float(), mask, "token_k1", 0.9, 1.25)
    assert torch.equal(batch["loss_mask"], mask * keep) and torch.equal(batch["response_mask"], mask)
    assert 0 < metrics["rs/rejected_fraction"] < 1 and "train_rows" not in batch
    assert metrics["rs/rejected_fraction"] == pytest.approx(1 - float(batch["loss_mask"].sum() / mask.sum()))
    for key in ("mismatch/kl_k1", "mismatch/kl_k3", "mismatch/ppl_ratio", "mismatch/logprob_diff_mean",
                "is/weight_mean", "is/weight_max", "is/capped_fraction", "is/zeroed_fraction",
                "rollout/logprob_diff_mean", "rollout/is_weight_mean", "rollout/is_capped_fraction"):
        assert key in metrics, key
    assert metrics["mismatch/logprob_diff_mean"] == metrics["rollout/logprob_diff_mean"]


def test_sequence_rejection_leaves_samples_out_as_before():
    mask, batch, metrics = _trainer_step("seq_sum_k2")
    keep = rc.rejection_keep(V["old"].float(), V["rollout"].float(), mask, "seq_sum_k2",
                             threshold=0.01).all(dim=1)
    assert batch["train_rows"].tolist() == keep.tolist() and 0 < int(keep.sum()) < len(keep)
    assert torch.equal(batch["loss_mask"], mask * keep[:, None])
    assert torch.equal(batch["response_mask"], mask)
    assert metrics["rollout/masked_fraction"] == pytest.approx(1 - keep.float().mean().item())
    assert "is/weight_mean" not in metrics
