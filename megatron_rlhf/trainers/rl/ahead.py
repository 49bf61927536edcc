"""Generation ahead (``rollout.max_staleness = k > 0`` with a separate rollout group): the
rollout ranks generate the next ``k`` steps' samples with the weights they hold while the
trainers update, and every batch is checked for its age (weight versions behind the trainer).

With tools a step's trajectories take several rounds (generate, run the calls, continue), which
the driver drives: a thread of the driver runs them against the rollout group while the
trainers update, and the next weight sync waits for it, so every turn of a trajectory comes from
one weight version (the version its staleness names)."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from megatron_rlhf.rollout.engines import stitched


@dataclass
class InFlight:
    """A step's generation started ahead on the separate rollout group."""

    refs: list | Future  # the rollout ranks' result references; with tools, the driver thread's
    version: int  # the step whose weights the engines held when it started
    started_at: int  # the step whose update it overlaps


class GenerationAhead:
    """:class:`megatron_rlhf.trainers.rl.agent.PPORun`'s generation ahead. It uses the run's
    ``cfg``, ``rollout_group``, ``engine_version``, ``inflight``, ``update_spans``,
    ``total_steps``, ``online_prompts``, ``sampling``, ``tools``, ``ahead_thread`` and
    ``tool_trajectories``."""

    def staleness(self, step: int, version: int) -> dict[str, float]:
        """``rollout/staleness`` of a batch sampled by the weights of step ``version``, checked
        against ``rollout.max_staleness`` (a larger age is a scheduling bug, not a setting)."""
        age = step - version
        if not 0 <= age <= self.cfg.rollout.max_staleness:
            raise RuntimeError(f"step {step + 1}: its samples come from the weights of step "
                               f"{version}, {age} updates old; rollout.max_staleness="
                               f"{self.cfg.rollout.max_staleness}")
        return {"rollout/staleness": float(age)} if self.rollout_group is not None else {}

    def start_ahead(self, step: int) -> None:
        """``rollout.max_staleness = k > 0``: the separate rollout group starts generating the
        steps up to ``step + k`` with the weights it holds, while ``step`` updates (the next
        weight sync queues behind them on its ranks)."""
        from megatron_rlhf.trainers.rl.rollout_worker import RolloutWorker

        last = min(step + self.cfg.rollout.max_staleness, self.total_steps - 1)
        for ahead in range(step + 1, last + 1):
            if ahead not in self.inflight:
                prompts = self.online_prompts(ahead)
                if self.tools is not None:
                    refs = self._ahead_thread.submit(self._timed_tool_trajectories, prompts, self.sampling(ahead))
                else:
                    refs = self.rollout_group.submit(RolloutWorker.generate, [list(p.ids) for p in prompts],
                                                     self.sampling(ahead))
                self.inflight[ahead] = InFlight(refs, self.engine_version, step)

    @property
    def _ahead_thread(self) -> ThreadPoolExecutor:
        """One thread: the steps in flight run their rounds one after the other, in order."""
        if self.ahead_thread is None:
            self.ahead_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ahead")
        return self.ahead_thread

    def _timed_tool_trajectories(self, prompts: list, params) -> dict:
        """A step's tool trajectories on the rollout group (the driver's thread), their
        ``tools/*`` metrics and when they ran."""
        start = time.time()
        gens, metrics = self.tool_trajectories(prompts, params)
        return {"gens": gens, "metrics": metrics, "span": (start, time.time())}

    def wait_ahead(self) -> int:
        """With tools, before a weight sync: the trajectories started ahead finish every turn on
        the weights they started with (the sync would otherwise land between two rounds).
        Returns how many steps' tool rounds were still running, which the sync waited for."""
        running = [f for f in self.inflight.values() if isinstance(f.refs, Future) and not f.refs.done()]
        for flight in self.inflight.values():
            if isinstance(flight.refs, Future):
                flight.refs.result()
        return len(running)

    def take_ahead(self, step: int) -> dict | None:
        """The generations started ahead for ``step`` (with their staleness and overlap), or
        None when none were."""
        flight = self.inflight.pop(step, None)
        if flight is None:
            return None
        from megatron_rlhf.trainers.rl.rollout_worker import RolloutWorker

        if isinstance(flight.refs, Future):
            done = flight.refs.result()
            gens, extra, (start, end) = done["gens"], done["metrics"], done["span"]
        else:
            gens, extra = stitched(self.rollout_group._get(flight.refs, "generate")), {}
            spans = [s for s in self.rollout_group.call(RolloutWorker.span, self.sampling(step).seed) if s]
            start, end = min(s[0] for s in spans), max(s[1] for s in spans)
        update = self.update_spans.get(flight.started_at, (0.0, 0.0))
        overlap = max(0.0, min(end, update[1]) - max(start, update[0]))
        return {"gens": gens, "timing/overlap": overlap, "busy/rollout_seconds": end - start,
                **extra, **self.staleness(step, flight.version)}

    def cancel_ahead(self) -> None:
        """Drop generations started ahead (a rollback or restore changes the weights they were
        meant to follow); their ranks finish them first, in order."""
        for flight in self.inflight.values():
            if isinstance(flight.refs, Future):
                flight.refs.result()
            else:
                self.rollout_group._get(flight.refs, "generate")
        self.inflight.clear()


def busy_fractions(metrics: dict[str, float], step_seconds: float, separate: bool) -> dict[str, float]:
    """Share of a step's wall time each worker group worked: ``busy/trainers`` (every timed phase
    but a separate group's generation, which the trainers only wait for) and, with a separate
    rollout group, ``busy/rollout`` (its generation: the batch's own, started ahead or not)."""
    timing = {k: v for k, v in metrics.items() if k.startswith("timing/") and k != "timing/overlap"}
    generation = sum(v for k, v in timing.items() if k.split("/")[1] == "gen")
    trainers = sum(timing.values()) - (generation if separate else 0.0)
    out = {"busy/trainers": min(1.0, trainers / step_seconds)}
    if separate:
        rollout = metrics.get("busy/rollout_seconds", generation)
        out["busy/rollout"] = min(1.0, rollout / step_seconds)
    return out


def dump_rollouts(folder: Path, step: int, episode, version: int) -> None:
    """``trainer.rollout_data_dir``: step ``step``'s samples as JSON lines (written whole, then
    renamed, so a killed run never leaves half a file)."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    scores = episode.scored["score"].tolist()
    turns = episode.scored.get("turns")
    lines = []
    for row, (g, score) in enumerate(zip(episode.gens, scores)):
        line = {"step": step, "prompt_ids": list(episode.prompts[g.prompt_index].ids),
                "response_ids": g.tokens, "logprobs": g.logprobs, "score": score, "weight_version": version}
        if g.mask is not None:  # multi-turn: 1 on the policy's tokens, 0 on the environment's
            line["mask"] = g.mask
        if g.messages is not None:  # a tool trajectory's conversation
            line["messages"] = g.messages
        if turns is not None and g.turn_ends:  # each turn's reward (at its last token)
            first = int(episode.batch["loss_mask"][row].nonzero()[0])
            line["turn_rewards"] = [float(turns[row, first + end]) for end in g.turn_ends]
        lines.append(json.dumps(line))
    path = folder / f"step_{step}.jsonl"
    path.with_suffix(".partial").write_text("\n".join(lines) + "\n")
    path.with_suffix(".partial").replace(path)
