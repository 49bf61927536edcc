"""Offload between optimizer steps is bitwise invisible; run under torchrun (2 ranks) by
tests/test_offload.py.

For every layout (DP2, TP2, PP2, EP2 on a mixture-of-experts model), with and without the
distributed optimizer (and bf16 at DP2: separate fp32 main weights), 3 optimizer steps with
params + grads + optimizer offloaded before and after every step against the same 3 steps
without; rank 0 writes ``case -> {...}`` (each value agreed over ranks).
Usage: torchrun --nproc-per-node 2 tests/dist_offload.py DENSE_HF MOE_HF OUT.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rlhf.config.schema import OptimConfig  # noqa: E402
from megatron_rlhf.distributed.launch import init_distributed  # noqa: E402
from megatron_rlhf.models.forward import token_cross_entropy  # noqa: E402
from megatron_rlhf.trainers.engine import make_trainable, train_step  # noqa: E402
from megatron_rlhf.trainers.offload import PARTS, Offloader  # noqa: E402
from tests.dist_parity import layout_groups, write_results_and_leave  # noqa: E402

STEPS = 3
ALL = dict.fromkeys(PARTS, True)
# case -> (model, ParallelLayout fields (tp, pp, dp, ep), distributed optimizer, dtype)
CASES = {f"{name}/{'distopt' if dist_opt else 'plain'}": (model, layout, dist_opt, torch.float32)
         for name, model, layout in (("dp2", "dense", (1, 1)), ("tp2", "dense", (2, 1)),
                                     ("pp2", "dense", (1, 2)), ("ep2", "moe", (1, 1, None, 2)))
         for dist_opt in (False, True)}
CASES |= {f"dp2_bf16/{'distopt' if d else 'plain'}": ("dense", (1, 1), d, torch.bfloat16)
          for d in (False, True)}


def all_ranks(flag: bool) -> bool:
    tensor = torch.tensor([0.0 if flag else 1.0])
    dist.all_reduce(tensor)
    return tensor.item() == 0


def build(path: Path, layout, dtype):
    """:func:`tests.dist_parity.from_hf` in ``dtype``."""
    from megatron_rlhf.checkpoint.hf_io import HFReader
    from megatron_rlhf.convert.checkpoints import read_hf_arch
    from megatron_rlhf.convert.weights import load_hf_weights
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.models.hf_config import padded_vocab_size
    from megatron_rlhf.models.megatron_config import ModelOptions

    arch = read_hf_arch(path)
    groups = layout_groups(layout, arch.shape)
    padded = padded_vocab_size(arch.vocab_size, groups.layout.tp)
    model = build_model(arch, groups, dtype, padded, ModelOptions(sequence_parallel=layout[0] > 1))
    load_hf_weights(model, HFReader(path), arch, groups, padded, progress=False)
    return model, groups, arch


def run(path: Path, layout, dist_opt: bool, dtype, offload: bool) -> dict:
    """3 steps; with ``offload``, everything out before and after each (checked to be gone)."""
    model, groups, arch = build(path, layout, dtype)
    trainable = make_trainable(model, groups, OptimConfig(lr=3e-3, warmup_steps_ratio=0.0),
                               total_steps=STEPS, distributed_optimizer=dist_opt)
    rows = torch.randint(0, 250, (8, 16), generator=torch.Generator().manual_seed(5))
    mine = rows[groups.dp_rank * 4:(groups.dp_rank + 1) * 4]
    batches = [{"input_ids": mine[i:i + 2], "targets": torch.roll(mine[i:i + 2], -1, dims=1)}
               for i in (0, 2)]

    def loss_fn(output, batch):
        loss = token_cross_entropy(output.float(), batch["targets"], arch.vocab_size, groups).mean()
        return loss, {"loss": loss.detach()}

    offloader = Offloader.of(trainable)
    out = {"losses": [], "grad_norms": [], "freed": True, "host_stable": True, "bytes": 0}
    hosts = []
    for _ in range(STEPS):
        if offload:
            out["bytes"] = offloader.offload(**ALL).bytes
            out["freed"] &= all(offloader.resident_bytes(p) == 0 for p in PARTS)
            out["freed"] &= all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
            hosts.append(offloader.host_buffers())
            offloader.reload(**ALL)
        result = train_step(trainable, batches, loss_fn)
        out["losses"] += [float(m["loss"]) for m in result.metrics]
        out["grad_norms"].append(result.grad_norm)
    if offload:
        offloader.offload(**ALL)
        out["freed"] &= all(offloader.resident_bytes(p) == 0 for p in PARTS)
        hosts.append(offloader.host_buffers())
        # Steps 1..3 reuse the buffers made before step 1 (params, grads, main weights) and
        # after it (Adam's moments), never new ones.
        out["host_stable"] = len(hosts[1]) > len(hosts[0]) and all(h == hosts[1] for h in hosts[2:])
        offloader.reload(**ALL)
    out["tensors"] = ([p.detach().clone() for p in model.parameters()]
                      + [t.detach().clone() for t in offloader._tensors("optimizer")])
    out["state_tensors"] = sum(len(s) for o in offloader._torch_optimizers() for s in o.state.values())
    return out


def compare(path: Path, layout, dist_opt: bool, dtype) -> dict:
    plain = run(path, layout, dist_opt, dtype, offload=False)
    moved = run(path, layout, dist_opt, dtype, offload=True)
    same = (plain["losses"] == moved["losses"] and plain["grad_norms"] == moved["grad_norms"]
            and len(plain["tensors"]) == len(moved["tensors"])
            and all(torch.equal(a, b) for a, b in zip(plain["tensors"], moved["tensors"])))
    return {"bitwise": all_ranks(same), "freed": all_ranks(moved["freed"]),
            "host_stable": all_ranks(moved["host_stable"]),
            "state_tensors": moved["state_tensors"] > 0, "bytes": moved["bytes"],
            "losses": plain["losses"]}


def main() -> None:
    dense, moe, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    init_distributed()
    results = {}
    for case, (model, layout, dist_opt, dtype) in CASES.items():
        results[case] = compare(dense if model == "dense" else moe, layout, dist_opt, dtype)
    write_results_and_leave(out, results)


if __name__ == "__main__":
    main()
