"""Routing statistics of a model's MoE layers, per optimizer step: what a user watches to see
whether experts collapse. Collective: every rank of the model's world calls :meth:`collect`."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rlhf.distributed.layout import ParallelGroups
from megatron_rlhf.distributed.platform import device


class MoEMonitor:
    """Counts the tokens each expert receives in training forwards and reads megatron's
    auxiliary-loss tracker; :meth:`collect` returns the step's ``moe/*`` scalars."""

    def __init__(self, model, groups: ParallelGroups):
        from megatron.core.transformer.moe.router import TopKRouter

        self.groups = groups
        config = model.config
        # megatron's loss tracker is one per process (the actor's and the critic's share it):
        # each monitor reads the losses its own model's coefficients switch on.
        balancing = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}
        self.losses = ([balancing[config.moe_router_load_balancing_type]]
                       if config.moe_aux_loss_coeff and config.moe_router_load_balancing_type in balancing
                       else []) + (["z_loss"] if config.moe_z_loss_coeff else [])
        self.num_layers, self.num_experts = config.num_layers, config.num_moe_experts
        self.routers = {m.layer_number - 1: m for m in model.modules() if isinstance(m, TopKRouter)}
        self.counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64,
                                  device=device())
        for layer, router in self.routers.items():
            router.register_forward_hook(self._counter(layer))

    def _counter(self, layer: int):
        def hook(module, _inputs, output):
            if module.training and torch.is_grad_enabled():
                self.counts[layer] += output[1].sum(dim=0).to(self.counts)
        return hook

    def collect(self, micro_batches: int) -> dict[str, float]:
        """The step's means over MoE layers (and micro-batches): load-balancing and z-losses
        (when their coefficients are on), tokens-per-expert imbalance (max/mean over experts:
        1 is perfectly balanced), and the expert-bias spread (max - min) where routers have one."""
        from megatron.core.transformer.moe.moe_utils import (get_moe_layer_wise_logging_tracker,
                                                             reduce_aux_losses_tracker_across_ranks)

        out = {}
        counts = self.counts.clone()
        dist.all_reduce(counts)  # each layer lives on one stage; tokens split over DP/TP/EP
        self.counts.zero_()
        routed = counts[counts.sum(dim=1) > 0]
        if len(routed):
            imbalance = routed.max(dim=1).values / routed.mean(dim=1)
            out["moe/tokens_per_expert_max_over_mean"] = imbalance.mean().item()
        tracker = get_moe_layer_wise_logging_tracker()
        names = [name for name in self.losses if name in tracker]  # the same on every rank
        if names:
            reduce_aux_losses_tracker_across_ranks(names, pg_collection=self.groups.collection)
            for name in names:
                total = tracker[name]["values"].sum().item()
                out[f"moe/{name}"] = total / max(micro_batches, 1) / max(len(routed), 1)
                tracker[name]["values"].zero_()
        spread = self._bias_spread()
        if spread is not None:
            out["moe/expert_bias_spread"] = spread
        return out

    def _bias_spread(self) -> float | None:
        """Mean over layers of max - min expert bias; collective over the pipeline stages."""
        values = torch.zeros(2, dtype=torch.float64, device=device())
        for router in self.routers.values():
            bias = getattr(router, "expert_bias", None)
            if bias is not None:
                values += torch.stack([(bias.max() - bias.min()).double(), torch.ones((), dtype=torch.float64)])
        dist.all_reduce(values, group=self.groups.pp)
        return (values[0] / values[1]).item() if values[1] > 0 else None
