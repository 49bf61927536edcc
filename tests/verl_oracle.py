"""verl 0.9.1's own math on given inputs: the oracle tests/test_recipes.py compares ours against.

Runs in the oracle environment (``tools/oracle_env.sh``), never in the project's, and imports
nothing of ``megatron_rlhf``::

    .venv-oracle/bin/python tests/verl_oracle.py CASES.pt RESULTS.pt

``CASES.pt`` (``torch.save``): ``{case name: (function, kwargs)}`` with ``function`` one of
:data:`FUNCTIONS` and tensors, numbers and strings as ``kwargs``; ``RESULTS.pt``: ``{case name:
what the function returned}`` (tensors and floats, in tuples, lists and dicts). Each function
is a thin call into ``verl.trainer.ppo.core_algos`` or ``verl.trainer.ppo.rollout_corr_helper``
that builds verl's config objects from plain numbers; verl does the math.
"""

import sys

import torch
import verl.utils.torch_functional as verl_F
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos as core
from verl.trainer.ppo import rollout_corr_helper as corr
from verl.workers.config import ActorConfig


def agg_loss(loss, mask, mode, horizon=None):
    return core.agg_loss(loss, mask, mode, loss_scale_factor=horizon)


def gae(rewards, values, mask, gamma, lam):
    """(advantages whitened over the mask, returns), as verl always whitens GAE's."""
    return core.compute_gae_advantage_return(rewards, values, mask, gamma, lam)


def grpo(rewards, mask, index, norm_by_std):
    # verl groups by ``index[i]`` as a dict key: a numpy array, not a tensor (0-dim tensors hash
    # by identity, so every sample would be its own group).
    return core.compute_grpo_outcome_advantage(rewards, mask, index.numpy(),
                                               norm_adv_by_std_in_grpo=norm_by_std)[0]


def rloo(rewards, mask, index):
    return core.compute_rloo_outcome_advantage(rewards, mask, index.numpy())[0]


def reinforce_pp(rewards, mask, gamma):
    return core.compute_reinforce_plus_plus_outcome_advantage(rewards, mask,
                                                              config=AlgoConfig(gamma=gamma))


def reinforce_pp_baseline(rewards, mask, index):
    return core.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask,
                                                                       index.numpy())[0]


def kl_penalty(logprob, ref_logprob, kind):
    return core.kl_penalty(logprob, ref_logprob, kind)


def policy_loss(name, old_logprob, logprob, advantages, mask, agg_mode, clip_low, clip_high,
                clip_ratio_c=3.0, weights=None):
    """verl's registered policy loss ``name`` (vanilla, gspo): its value, its metrics and the
    gradient of the loss with respect to ``logprob``."""
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                         clip_ratio_low=clip_low, clip_ratio_high=clip_high,
                         clip_ratio_c=clip_ratio_c)
    logprob = logprob.clone().requires_grad_()
    loss, metrics = core.get_policy_loss_fn(name)(old_logprob, logprob, advantages, mask, agg_mode,
                                                  config, weights)
    loss.backward()
    return {"loss": loss.detach(), "grad": logprob.grad, **metrics}


def value_loss(vpreds, returns, values, mask, cliprange_value, agg_mode):
    return core.compute_value_loss(vpreds, returns, values, mask, cliprange_value, agg_mode)


def entropy(logits, mask, agg_mode):
    return {"per_token": verl_F.entropy_from_logits(logits),
            "loss": core.compute_entropy_loss(logits, mask, agg_mode)}


def adaptive_kl(init_kl_coef, target, horizon, updates):
    """The coefficient after each ``(current_kl, n_steps)`` update."""
    controller = core.AdaptiveKLController(init_kl_coef, target, horizon)
    values = []
    for current_kl, n_steps in updates:
        controller.update(current_kl, n_steps)
        values.append(float(controller.value))
    return values


def is_weights(old_logprob, rollout_logprob, mask, level, cap, batch_normalize=False):
    """``cap``: a number (TIS) or verl's ``"lower_upper"`` string (IcePop)."""
    return corr.compute_rollout_correction_weights(old_logprob - rollout_logprob, mask, level,
                                                   cap, batch_normalize)[0]


def rejection_mask(old_logprob, rollout_logprob, mask, option, threshold):
    return corr.compute_rollout_rejection_mask(old_logprob - rollout_logprob, mask, option,
                                               threshold)[0]


def correction(old_logprob, rollout_logprob, mask, rollout_is=None, is_threshold=2.0,
               batch_normalize=False, rollout_rs=None, rs_threshold=None):
    """verl's whole decoupled-mode correction of one batch: IS weights (or None), the response
    mask after rejection, and its metrics (``rollout_corr/`` prefix dropped)."""
    weights, new_mask, metrics = corr.compute_rollout_correction_and_rejection_mask(
        old_logprob, rollout_logprob, mask, rollout_is, is_threshold, batch_normalize, rollout_rs,
        rs_threshold)
    return {"weights": None if weights is None else weights.batch["rollout_is_weights"],
            "mask": new_mask,
            "metrics": {k.removeprefix("rollout_corr/"): float(v) for k, v in metrics.items()}}


def offpolicy_metrics(old_logprob, rollout_logprob, mask):
    return corr.compute_offpolicy_metrics(old_logprob, rollout_logprob, mask)


def bypass_loss(loss_type, rollout_logprob, logprob, advantages, mask, agg_mode, clip_low,
                clip_high, clip_ratio_c=3.0):
    """verl's bypass-mode loss (``old_log_prob`` = the rollout's), no IS or rejection: its value,
    metrics and gradient with respect to ``logprob``."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.workers.config.actor import PolicyLossConfig

    settings = RolloutCorrectionConfig(rollout_is=None, rollout_rs=None, bypass_mode=True,
                                       loss_type=loss_type)
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                         clip_ratio_low=clip_low, clip_ratio_high=clip_high,
                         clip_ratio_c=clip_ratio_c,
                         policy_loss=PolicyLossConfig(loss_mode="bypass_mode",
                                                      rollout_correction=settings))
    logprob = logprob.clone().requires_grad_()
    loss, metrics = core.get_policy_loss_fn("bypass_mode")(rollout_logprob, logprob, advantages,
                                                           mask, agg_mode, config, None)
    loss.backward()
    return {"loss": loss.detach(), "grad": logprob.grad,
            **{k: v for k, v in metrics.items() if k.startswith("actor/")}}


def reinforce_loss(rollout_logprob, logprob, advantages, mask, agg_mode, weights=None):
    """verl's ``compute_policy_loss_reinforce`` with explicit IS weights: value, metrics, gradient."""
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    logprob = logprob.clone().requires_grad_()
    loss, metrics = core.compute_policy_loss_reinforce(rollout_logprob, logprob, advantages, mask,
                                                       agg_mode, config, weights)
    loss.backward()
    return {"loss": loss.detach(), "grad": logprob.grad, **metrics}


FUNCTIONS = {f.__name__: f for f in (agg_loss, gae, grpo, rloo, reinforce_pp, reinforce_pp_baseline,
                                     kl_penalty, policy_loss, value_loss, entropy, adaptive_kl,
                                     is_weights, rejection_mask, correction, offpolicy_metrics,
                                     bypass_loss, reinforce_loss)}


def main(cases_path: str, results_path: str) -> None:
    cases = torch.load(cases_path)
    results = {name: FUNCTIONS[function](**kwargs) for name, (function, kwargs) in cases.items()}
    torch.save(results, results_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
