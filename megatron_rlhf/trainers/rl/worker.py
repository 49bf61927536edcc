"""One rank of a PPO worker group: the models it hosts and the work the driver asks of them.

Roles: ``actor`` (trainable policy, frozen reference, rollout engine and the weight sync between
them) and ``critic`` (trainable value model and the frozen reward model). With the default shared
resource pool every rank hosts both; with ``resource_pool.critic=separate`` two groups do.

Batches arrive whole (every rank gets the same dict of ``[N, T]`` tensors); each rank works on its
data-parallel slice and only the ranks holding a full result (TP rank 0 of the last pipeline
stage) return it, tagged with their DP rank, for the driver to stitch back together.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megatron_rlhf.algorithms.ppo import aggregate_denominator
from megatron_rlhf.algorithms.sppo import win_rates
from megatron_rlhf.config.loader import batch_plan
from megatron_rlhf.config.parallel import model_options
from megatron_rlhf.config.schema import prompt_sharing
from megatron_rlhf.config.ppo_checks import (critic_epochs, critic_parallel, scoring_temperature,
                                           uses_critic,
                                           uses_reference)
from megatron_rlhf.config.ppo_schema import PPOConfig
from megatron_rlhf.data.packing import grid_tensor, to_grid
from megatron_rlhf.distributed.layout import ParallelGroups, ParallelLayout, build_parallel_groups
from megatron_rlhf.models.forward import pipeline_forward
from megatron_rlhf.models.lora import adapters_disabled
from megatron_rlhf.rewards.rm_scorer import last_token_rewards
from megatron_rlhf.trainers.engine import (add_adapters, check_prompt_sharing, make_trainable,
                                          packing_supported, reduce_metrics, set_lr_scale,
                                          train_step, training_dtype)
from megatron_rlhf.trainers.offload import PARTS
from megatron_rlhf.trainers.rl.experience import Experience
from megatron_rlhf.trainers.rl.micro_batches import (dp_slice, group_major_order, in_row_order,
                                                     micro_batches, shared_token_groups,
                                                     token_counts, token_groups)
from megatron_rlhf.trainers.rl.policy import load_policy, reference_policy
from megatron_rlhf.trainers.rl.routing import own_routing, pass_mode, routing_replay
from megatron_rlhf.trainers.rl.residency import Residency
from megatron_rlhf.models.output_head import output_head
from megatron_rlhf.trainers.rl.losses import (actor_loss, critic_loss, grid_logprobs,
                                              loss_positions_logprobs)
from megatron_rlhf.trainers.rl.value_init import build_value_model, resolve_value_source, reward_model_source

ACTOR_KEYS = ["pg_loss", "loss_denominator", "clipfrac", "ppo_kl", "entropy", "kl", "tokens", "count"]
CRITIC_KEYS = ["vf_loss", "loss_denominator", "vf_clipfrac", "tokens", "count"]
LOSSES = ("pg_loss", "vf_loss")  # means over loss_denominator; the other metrics over tokens


class _SendOnly:
    """A trainer rank other than the bridge's sender: it runs the sync's gathers, sends nothing."""

    def send(self, buckets) -> int:
        return sum(1 for _ in buckets)


class PPOWorker:
    """Built by :class:`megatron_rlhf.orchestration.worker_group.WorkerGroup` after
    ``torch.distributed`` is up; ``roles`` is a subset of {"actor", "critic"}."""

    def __init__(self, config: PPOConfig, roles: tuple[str, ...], layout: ParallelLayout,
                 total_updates: dict[str, int]):
        self.config, self.roles = config, roles
        self.stop = _catch_stop_signals(config.trainer)
        self.writers: dict = {}  # role -> CheckpointWriter, made at the first save
        self.dtype = training_dtype(config.actor.dtype)
        self.groups = build_parallel_groups(layout, seed=config.trainer.seed)
        self.lr_scale = 1.0
        data = config.data
        self.pack_capacity = 0
        if packing_supported(data.use_remove_padding, "ppo"):
            self.pack_capacity = data.max_prompt_length + data.max_response_length
        self.share_prompts = prompt_sharing(data.share_prompts, bool(self.pack_capacity))
        if "actor" in roles:
            self._build_actor(total_updates["actor"])
        if "critic" in roles:
            self._build_critic(total_updates["critic"])
        self.residency = Residency.of_worker(self, config)  # what each phase brings back

    # ----------------------------------------------------------------------------- set-up
    def _build_actor(self, total_updates: int) -> None:
        from transformers import AutoConfig, AutoTokenizer

        from megatron_rlhf.data.chat import pad_id
        from megatron_rlhf.rollout.engines import make_generator
        from megatron_rlhf.rollout.weight_sync import WeightSync

        cfg = self.config
        # Routers get megatron's RouterReplay: recorded every step (moe/routing_agreement),
        # replayed with actor.router_replay.
        options = replace(model_options(cfg.actor.parallel, cfg.actor.moe), moe_routing_replay=True)
        model, self.arch, self.hf_dir, self.padded = load_policy(cfg.actor.model_path, self.groups,
                                                                 self.dtype, options)
        check_prompt_sharing(self.share_prompts, self.arch, cfg.actor.parallel, "ppo actor")
        self.lora = add_adapters(model, cfg.actor.lora, cfg.trainer.seed, "ppo actor",
                                 "actor.lora")
        self.ref = None  # with adapters: the actor's own model (run with them switched off)
        if uses_reference(cfg):
            self.ref = reference_policy(cfg, model, self.padded, self.groups, self.dtype, options)
        self.actor = make_trainable(model, self.groups, cfg.actor.optim, total_updates,
                                    cfg.actor.parallel.use_distributed_optimizer)
        sp = cfg.actor.parallel.sequence_parallel
        self.replay = routing_replay(self.actor.module, self.arch, self.groups, sp)
        self.ref_replay = (self.replay if self.ref is model else None if self.ref is None
                           else routing_replay(self.ref, self.arch, self.groups, sp))
        self.tokenizer = AutoTokenizer.from_pretrained(self.hf_dir, local_files_only=True)
        self.hf_config = AutoConfig.from_pretrained(self.hf_dir, local_files_only=True)
        self.pad_id = pad_id(self.tokenizer)
        self.generator, self.bridge = None, None  # a separate rollout group: a bridge to it
        if cfg.rollout.placement == "colocated":
            self.generator = make_generator(cfg.rollout, str(self.hf_dir), self.dtype,
                                            self.pad_id, self.tokenizer.eos_token_id, self.groups,
                                            adopt_storage=not cfg.actor.offload.params)
        self.sync = WeightSync(self.actor.module, self.arch, self.groups, self.padded,
                               int(cfg.rollout.bucket_size_mb * 2 ** 20))
        self._released = True  # the engine holds random weights until the first sync

    def _build_critic(self, total_updates: int) -> None:
        cfg = self.config
        parallel = critic_parallel(cfg)
        options = model_options(parallel, cfg.critic.moe)
        self.critic = None  # group baselines (GRPO, RLOO) need no value model
        if uses_critic(cfg):
            source = resolve_value_source(cfg.critic.model_path or cfg.actor.model_path,
                                          self.groups.layout)
            check_prompt_sharing(self.share_prompts, source.arch, parallel, "ppo critic")
            model = build_value_model(source, self.groups, self.dtype, cfg.trainer.seed, options)
            self.critic_lora = add_adapters(model, cfg.critic.lora, cfg.trainer.seed,
                                            "ppo critic", "critic.lora")
            self.critic = make_trainable(model, self.groups, cfg.critic.optim, total_updates,
                                         parallel.use_distributed_optimizer)
            self.critic_meta = source
        self.rm = None
        if cfg.reward.model_path:
            rm_source = reward_model_source(cfg.reward.model_path, self.groups.layout)
            self.rm = build_value_model(rm_source, self.groups, self.dtype, cfg.trainer.seed,
                                        options).eval()

    def info(self) -> dict:
        """What the driver needs to know about this rank."""
        g = self.groups
        return {"dp_rank": g.dp_rank, "dp": g.layout.dp, "output": g.tp_rank == 0 and g.is_last_stage,
                "layout": str(g.layout)}

    def _output(self, value):
        g = self.groups
        return (g.dp_rank, value) if g.tp_rank == 0 and g.is_last_stage else None

    # ----------------------------------------------------------------------------- rollout
    def generate(self, prompts: list[list[int]], params, release: bool = False) -> tuple | None:
        """This rank's engine's share of ``prompts``; ``release`` frees the engine's memory
        afterwards (what :meth:`release_rollout` does, without a second call). SGLang's order:
        ``weights`` back, the sync, the trainer's state out (every phase ends so), ``kv_cache``
        back, generate."""
        from megatron_rlhf.rollout.engines import engine_share

        if self._released:  # memory given back since the last sync: reload the current weights
            self.sync_weights()
        self.generator.resume_memory(["kv_cache"])
        self.residency.generation_starts()  # offload/resident_bytes_generating: 0 expected
        result = engine_share(self.generator, prompts, params)
        if release:
            self.release_rollout()
        return result

    def sync_weights(self) -> dict:
        """Every bucket into this rank's engine, or over the bridge to a separate rollout group."""
        if self.bridge is not None:
            with self.residency.phase(actor=("params",)):
                return {"buckets": float(self.bridge.send(self.sync.iter_buckets())),
                        "bytes": float(self.sync.total_bytes)}
        self.generator.resume_memory(["weights"])  # the KV cache waits for the trainer to step aside
        self._released = False
        with self.residency.phase(actor=("params",)):
            return self.sync.sync(self.generator.load_weights)

    def offload_stats(self) -> dict[str, float]:
        """This rank's ``offload/*`` moves since the last call ({} with every switch off)."""
        return self.residency.take_stats()

    def release_rollout(self) -> None:
        if self.generator is not None:
            self.generator.release_memory()
            self._released = True

    def rollout_spec(self) -> dict:
        """What a separate rollout group's engines are built from."""
        return {"hf_dir": str(self.hf_dir), "dtype": self.dtype, "pad_id": self.pad_id,
                "eos_id": self.tokenizer.eos_token_id}

    def open_bridge(self, host: str, port: int, size: int) -> None:
        """Rank 0 sends the weights to a separate rollout group's ``size - 1`` ranks; the other
        ranks only take part in the sync's gathers."""
        import torch.distributed as dist

        from megatron_rlhf.rollout.bridge import WeightBridge, bucket_plan

        from megatron_rlhf.distributed.platform import platform_is_cpu

        self.bridge = _SendOnly()
        if dist.get_rank() == 0:
            device = "cpu" if platform_is_cpu() else f"cuda:{torch.cuda.current_device()}"
            self.bridge = WeightBridge(host, port, 0, size, device)
            self.bridge.share_plan(bucket_plan(self.sync.buckets), self.dtype)

    # ----------------------------------------------------------------------------- experience
    def _mine(self, batch: dict) -> list[int]:
        count = batch["input_ids"].shape[0]
        return list(range(count))[dp_slice(count, self.groups.layout.dp, self.groups.dp_rank)]

    def _micro(self, batch: dict, rows: list[int], extra: dict | None = None):
        """(micro-batches of ``rows``, the rows in their order): ``actor.ppo_micro_batch_size_per_rank``
        samples each, or packed up to ``actor.ppo_micro_batch_tokens_per_rank`` tokens."""
        budget, share = self.config.actor.ppo_micro_batch_tokens_per_rank, self.share_prompts
        if budget and self.pack_capacity:
            groups = (shared_token_groups(batch, rows, budget) if share
                      else token_groups(batch["lengths"], rows, budget))
            # Rows stay one sample long at most (one group, shared): with a dense mask,
            # attention costs the square of a row's length, so one row of the whole budget is
            # slower.
            micro = [micro_batches(batch, g, len(g), extra, self.pack_capacity, share)[0]
                     for g in groups]
            return micro, [r for g in groups for r in g]
        size = self.config.actor.ppo_micro_batch_size_per_rank
        return micro_batches(batch, rows, size, extra, self.pack_capacity, share), rows

    def _forward(self, model, batch: dict, head, hidden_states: bool = False,
                 replay=None, which: str = "old") -> torch.Tensor | None:
        """``head``'s results ``[n_mine, ...]``; with a MoE ``replay`` driver, replaying and
        recording as ``which`` pass does (the routers' own choices land in ``self.own_routing``,
        the experts a replaying pass ran in ``self.used_routing``)."""
        mine = self._mine(batch)
        micro, order = self._micro(batch, mine)
        if replay is not None:
            replay.start(*pass_mode(self.config.actor.router_replay, batch, which))
        try:
            outputs = pipeline_forward(model, self.groups, micro, head, hidden_states, replay)
            if replay is not None and replay.recording:
                width = batch["input_ids"].shape[1]
                self.own_routing = in_row_order(own_routing(replay, self.groups, micro, width),
                                                mine, order)
                if replay.replaying:  # the experts it ran: the replayed ones, if replay works
                    self.used_routing = in_row_order(own_routing(
                        replay, self.groups, micro, width, used=True), mine, order)
        finally:
            if replay is not None:
                replay.stop()
        if not outputs:
            return None
        width = batch["input_ids"].shape[1]
        result = torch.cat([torch.nn.functional.pad(o, (0, width - o.shape[1])) if o.dim() == 2 else o
                            for o in outputs])
        return in_row_order(result, mine, order)

    def compute_log_probs(self, batch: Experience, old: bool = True, ref: bool = True) -> tuple | None:
        """Old (actor) and reference log-probs of the target tokens, ``[n_mine, T]`` each (None
        for the ones not asked for)."""
        temperature = scoring_temperature(self.config.rollout.temperature)

        def log_probs(model, replay, which):
            head = self._output_head(model)
            if head is None:
                score = lambda out, b: (grid_logprobs(out, b, self.arch.vocab_size, self.groups,  # noqa: E731
                                                      temperature) * grid_tensor(b, "loss_mask"))
                return self._forward(model, batch, score, replay=replay, which=which)
            score = lambda out, b: loss_positions_logprobs(out, b, head, temperature)[0]  # noqa: E731
            return self._forward(model, batch, score, hidden_states=True, replay=replay, which=which)

        self.own_routing = self.used_routing = None
        base = self.ref is self.actor.module  # LoRA: the reference is the actor, adapters off
        with self.residency.phase(actor=("params",) if old or (ref and base) else (),
                                  ref=("params",) if ref else ()):
            old = log_probs(self.actor.module, self.replay, "old") if old else None
            reference = None
            if ref:
                with adapters_disabled(self.ref):  # no adapters (a separate reference): no change
                    reference = log_probs(self.ref, self.ref_replay, "ref")
        return self._output((old, reference, self.own_routing, self.used_routing))

    def _output_head(self, model):
        """The chunked output head of ``model`` (``actor.logprob_chunk_tokens``); None when full
        logits are asked for, or on a stage without the output layer."""
        chunk = self.config.actor.logprob_chunk_tokens
        if not chunk or not self.groups.is_last_stage:
            return None
        return output_head(model, self.arch.vocab_size, self.groups.tp, self.groups.tp_rank, chunk)

    def compute_values(self, batch: Experience) -> tuple | None:
        """Critic values ``[n_mine, T]`` and reward-model scores ``[n_mine]`` (or None)."""
        values = scores = None
        with self.residency.phase(critic=("params",), rm=("params",)):
            if self.critic is not None:
                values = self._forward(self.critic.module, batch, lambda out, b: to_grid(
                    out[..., 0].float(), b) * grid_tensor(b, "loss_mask"))
            if self.rm is not None:
                scores = self._forward(self.rm, batch, lambda out, b: last_token_rewards(
                    to_grid(out, b), grid_tensor(b, "lengths")[:, 0]))
        return self._output((values, scores))

    # ----------------------------------------------------------------------------- updates
    def _update(self, trainable, batch: dict, epochs: int, step: int, loss, keys, denominator,
                hidden_states: bool = False, replay=None):
        """``epochs`` passes of mini-batch optimizer steps over the whole batch."""
        cfg, g = self.config, self.groups
        count = batch["input_ids"].shape[0]
        plan = batch_plan(min(cfg.actor.ppo_mini_batch_size, count),
                          cfg.actor.ppo_micro_batch_size_per_rank, g.layout.dp)
        sums, tokens = [], torch.zeros(3, dtype=torch.float64)
        for epoch in range(epochs):
            generator = torch.Generator().manual_seed(cfg.trainer.seed * 7919 + step * 31 + epoch)
            order = (group_major_order(batch["group"], generator) if self.share_prompts
                     else torch.randperm(count, generator=generator).tolist())
            for start in range(0, count, plan.per_step):
                rows = order[start:start + plan.per_step]
                mine = rows[dp_slice(len(rows), g.layout.dp, g.dp_rank)]
                micro, _ = self._micro(batch, mine)
                # Megatron divides each micro-batch's loss by this rank's micro-batch count and
                # DDP averages over ranks: the weight undoes both (counts may differ by rank).
                weight = len(micro) * g.layout.dp / denominator(batch, rows)
                for m in micro:
                    m["loss_weight"] = weight
                    tokens += torch.tensor(token_counts(m), dtype=torch.float64)
                # Inf/NaN comes back as metrics: the driver's guard rolls the step back.
                if replay is not None:
                    replay.start(*pass_mode(cfg.actor.router_replay, batch, "update"))
                try:
                    result = train_step(trainable, micro, loss, raise_on_nonfinite=False,
                                        hidden_states=hidden_states, replay=replay)
                finally:
                    if replay is not None:
                        replay.stop()
                sums.append(reduce_metrics(result.metrics, g, keys)
                            | {"grad_norm": result.grad_norm, "lr": result.lr, **result.moe})
        return sums, self._tokens_over_ranks(tokens)

    def _tokens_over_ranks(self, tokens: torch.Tensor) -> dict[str, float]:
        """An update's token counts (:func:`token_counts`) summed over data-parallel ranks:
        ``tokens_computed`` (what the model ran, shared prompts once, padding included),
        ``tokens_sample`` (the samples' own), ``prompt_groups_unshared``."""
        import torch.distributed as dist

        from megatron_rlhf.distributed.platform import device

        total = tokens.to(device())
        dist.all_reduce(total, group=self.groups.dp)
        computed, sample, unshared = total.tolist()
        return {"tokens_computed": computed, "tokens_sample": sample,
                "prompt_groups_unshared": unshared}

    def update_actor(self, batch: Experience, step: int, kl_loss_coef: float) -> dict:
        """One step's actor update. A multi-agent population batch carries the step's whole
        preference table instead of advantages: each agent's ranks derive their samples' SPPO
        targets from it, and report its digest so the driver can prove every rank of every
        agent trained on the same table."""
        cfg = self.config.actor
        digest = population_advantages(batch) if "preferences" in batch else None
        head = self._output_head(self.actor.module)
        loss = lambda out, b: actor_loss(out, b, vocab_size=self.arch.vocab_size,  # noqa: E731
                                         groups=self.groups, cfg=cfg, kl_loss_coef=kl_loss_coef,
                                         temperature=scoring_temperature(self.config.rollout.temperature),
                                         horizon=self.horizon, head=head)
        if self.replay is not None:
            self.replay.take_counts()  # the old and reference passes' are not the update's
        with self.residency.phase(actor=PARTS):
            sums, tokens = self._update(self.actor, batch, cfg.ppo_epochs, step, loss, ACTOR_KEYS,
                                        lambda b, rows: self._denominator(b, rows, cfg.loss_agg_mode),
                                        hidden_states=bool(cfg.logprob_chunk_tokens),
                                        replay=self.replay)
        out = (_average(sums, "actor") | {f"actor/{k}": v for k, v in tokens.items()}
               | self._replayed_in_update())
        if self.ref is None:  # no reference model: no KL to report
            del out["actor/kl"]
        if digest is not None:
            out["population/table_sha256"] = digest
        return out

    def _replayed_in_update(self) -> dict[str, float]:
        """Of the (token, MoE layer) routings the update was asked to replay (R2, R3), over every
        rank: the share its forwards ran exactly (``actor/moe/replay_ran``: 1 when the replay
        reaches the routers) and the share the routers would have chosen themselves
        (``actor/moe/replay_own``: below 1 when the replay changed something)."""
        if self.replay is None:
            return {}
        import torch.distributed as dist

        from megatron_rlhf.distributed.platform import device

        counts = torch.tensor(self.replay.take_counts(), dtype=torch.float64, device=device())
        dist.all_reduce(counts)
        asked, ran, own = counts.tolist()
        if not asked:
            return {}
        return {"actor/moe/replay_ran": ran / asked, "actor/moe/replay_own": own / asked}

    def weights_digest(self) -> str:
        """sha256 of this rank's actor parameters (its shards), in order: equal digests are
        bitwise-equal weights."""
        import hashlib

        h = hashlib.sha256()
        with self.residency.phase(actor=("params",)):
            for name, param in self.actor.module.named_parameters():
                h.update(name.encode())
                h.update(param.detach().float().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()

    def update_critic(self, batch: Experience, step: int) -> dict:
        cfg = self.config
        epochs = critic_epochs(cfg)
        loss = lambda out, b: critic_loss(out, b, cliprange_value=cfg.critic.cliprange_value,  # noqa: E731
                                          agg_mode=cfg.actor.loss_agg_mode, horizon=self.horizon)
        with self.residency.phase(critic=PARTS):
            sums, tokens = self._update(self.critic, batch, epochs, step + 10 ** 6, loss, CRITIC_KEYS,
                                        lambda b, rows: self._denominator(b, rows, cfg.actor.loss_agg_mode))
        return _average(sums, "critic") | {f"critic/{k}": v for k, v in tokens.items()}

    @property
    def horizon(self) -> int:
        """The response budget: ``seq-mean-token-sum-norm``'s constant divisor."""
        return self.config.data.max_response_length

    def _denominator(self, batch: dict, rows: list[int], agg_mode: str) -> float:
        """What the mini-batch's aggregate divides by: tokens, non-empty sequences (times the
        horizon), or 1 (see :func:`~megatron_rlhf.algorithms.ppo.aggregate_denominator`)."""
        mask = batch["loss_mask"][torch.tensor(rows)]
        return float(aggregate_denominator(mask, agg_mode, self.horizon))

    def set_lr_scale(self, scale: float) -> None:
        """Scale the learning-rate schedules (rollbacks lower it)."""
        self.lr_scale = scale
        pairs = []
        if "actor" in self.roles:
            pairs.append((self.actor, self.config.actor.optim))
        if "critic" in self.roles and self.critic is not None:
            pairs.append((self.critic, self.config.critic.optim))
        for trainable, optim in pairs:
            set_lr_scale(trainable, optim, scale)

    # ----------------------------------------------------------------------------- checkpoints
    def _writer(self, role: str, root: str):
        """This rank's checkpoint writer of ``role`` under ``root`` (made at the first save)."""
        from pathlib import Path

        from megatron_rlhf.checkpoint.train_ckpt import CheckpointWriter

        writers = self.writers
        if role not in writers:
            if role == "actor":
                meta = {"kind": "policy", "family": self.arch.family, "padded_vocab": self.padded,
                        **self.lora}
                trainable, config, tokenizer = self.actor, self.hf_config, self.tokenizer
            else:
                from transformers import AutoTokenizer

                from megatron_rlhf.trainers.rl.value_init import reward_model_hf_config

                source = self.critic_meta
                meta = {"kind": "value", "family": source.arch.family,
                        "padded_vocab": source.padded_vocab, **self.critic_lora}
                config, tokenizer = reward_model_hf_config(
                    source, AutoTokenizer.from_pretrained(source.hf_dir, local_files_only=True))
                trainable = self.critic
            writers[role] = CheckpointWriter(Path(root) / role, trainable, meta, config, tokenizer,
                                             None, self.config.trainer.async_save)
        return writers[role]

    def _trained(self) -> list[str]:
        return [role for role in ("actor", "critic") if role in self.roles
                and getattr(self, role, None) is not None]

    def save(self, root: str, step: int, state: dict) -> float:
        """Save this rank's models at ``step`` (committed at once, or by :meth:`finalize_saves`
        when asynchronous); the driver prunes once every group has committed. Returns the
        seconds the save kept this rank from training."""
        seconds = 0.0
        with self.residency.phase(actor=PARTS, critic=PARTS):
            for role in self._trained():
                writer = self._writer(role, root)
                writer.save(step, state)
                seconds += writer.seconds
        return seconds

    def finalize_saves(self, blocking: bool = False) -> list[tuple[str, int]]:
        """Commit finished asynchronous saves (``blocking``: wait for them): (role, step) each."""
        return [(role, step) for role, writer in self.writers.items()
                for step, _ in writer.finalize(blocking)]

    def stop_signal(self) -> str | None:
        """The stop signal this rank received itself (srun signals every task), if any."""
        return self.stop.received if self.stop is not None else None

    def load(self, root: str, step: int, lr_scale: float) -> None:
        """Load this rank's models at ``step``, then run their schedules at ``lr_scale``."""
        from pathlib import Path

        from megatron_rlhf.checkpoint.train_ckpt import load_train_checkpoint

        self.finalize_saves(blocking=True)  # a save in flight lands before anything is loaded
        name = f"step_{step:08d}"
        with self.residency.phase(actor=PARTS, critic=PARTS):
            for role in self._trained():
                load_train_checkpoint(Path(root) / role / name, getattr(self, role))
        self.set_lr_scale(lr_scale)


def population_advantages(batch: Experience) -> str:
    """Replace a population batch's ``preferences [M, M]``, ``population_group [M]`` and
    ``population_rows [N]`` (this agent's samples among the ``M``) by SPPO targets
    ``P(y > population) - 1/2`` on its response tokens (``advantages``, ``returns``); returns
    the table's sha256."""
    import hashlib

    table = batch.pop("preferences")
    groups, rows = batch.pop("population_group"), batch.pop("population_rows")
    rates = win_rates(table, groups)[rows]
    batch["advantages"] = (rates - 0.5)[:, None] * batch["loss_mask"]
    batch["returns"] = batch["advantages"]
    return hashlib.sha256(table.contiguous().numpy().tobytes()).hexdigest()


def _average(sums: list[dict], prefix: str) -> dict:
    """Means over all optimizer steps of this update: the loss over what ``loss_agg_mode``
    averages (tokens or sequences), the other per-token metrics over tokens, plain means for
    the grad norm and lr."""
    tokens = sum(s["tokens"] for s in sums) or 1.0
    denominator = sum(s["loss_denominator"] for s in sums) or 1.0
    out = {}
    for key in sums[0]:
        if key in ("tokens", "count", "loss_denominator"):
            continue
        if key in ("grad_norm", "lr") or key.startswith("moe/"):
            out[f"{prefix}/{key}"] = sum(s[key] for s in sums) / len(sums)
        else:
            out[f"{prefix}/{key}"] = sum(s[key] for s in sums) / (denominator if key in LOSSES else tokens)
    return out


def _catch_stop_signals(trainer):
    """A worker outlives a stop signal sent to it (srun signals every task; Ray's own handler
    would exit): the driver asks for it at the step boundary and saves first."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None  # signals reach the main thread only
    from megatron_rlhf.trainers.lifecycle import StopRequest

    return StopRequest(trainer, None).install()
