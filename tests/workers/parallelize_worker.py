"""What each strategy's setup did to the model, on 2 ranks: the steps it ran and their effects.

Usage: kiln run -n 2 parallelize_worker.py OUT. Every strategy is set up through :func:`recording`
(a subclass that notes each step it runs); rank 0 writes OUT/parallelize.json:
{case: [facts of rank 0, facts of rank 1]}. tests/test_parallelize.py reads it.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import kiln
from kiln.parallel import DDP, FSDP, Hybrid, Pipeline, TensorParallel, Zero1, Zero3, full_model_state_dict
from kiln.parallel.transforms.parallelize import STEPS
from parallel_model import PLAN, make_data, make_model


def recording(cls, *args, **kwargs):
    """An instance of a subclass of ``cls`` whose ``calls`` list each step it ran and on what
    (``"model"``: the module given to setup; ``"stage"``: another one, a pipeline stage)."""
    calls = []

    def spy(step):
        def apply(self, model, plan):
            calls.append((step, model))
            return getattr(super(recorder, self), f"apply_{step}")(model, plan)

        return apply

    recorder = type(f"Recording{cls.__name__}", (cls,), {f"apply_{step}": spy(step) for step in STEPS})
    strategy = recorder(*args, **kwargs)
    strategy.calls = calls
    return strategy


class RootOnlyFSDP(FSDP):
    """Overrides one step: a single fully_shard for the whole model instead of one per block."""

    def apply_data_parallel(self, model, plan):
        import dataclasses

        return super().apply_data_parallel(model, dataclasses.replace(plan, blocks=[]))


def _placements(param):
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return None
    return [str(p) for p in param.placements] + list(param.device_mesh.mesh_dim_names)


def facts(strategy):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = make_data(1, 4)[0]
    if isinstance(strategy, Pipeline):
        strategy.example_input = x  # trace now: the stage steps run during setup
    engine = kiln.Engine(model, opt, nn.CrossEntropyLoss(), strategy=strategy)
    inner = engine.strategy.unwrap(engine.model)
    return {
        "calls": [[step, "model" if module is model else "stage"] for step, module in strategy.calls],
        "wrapper": type(engine.model).__name__,
        "wraps_the_model": inner is model,
        "sharded": sorted(n for n, m in inner.named_modules() if isinstance(m, FSDPModule)),
        "placements": {n: _placements(p) for n, p in inner.named_parameters() if n.startswith(("inp.", "blocks.0."))},
        "optimizer": type(engine.optimizer).__name__
        if not isinstance(engine.optimizer, ZeroRedundancyOptimizer)
        else "ZeroRedundancyOptimizer",
        "optimizer_follows": all(
            any(p is q for q in engine.model.parameters()) for g in opt.param_groups for p in g["params"]
        ),
        "data_parallel": [engine.data_parallel_rank, engine.data_parallel_size],
    }


def train(strategy, steps=3):
    """Full weights after a few AdamW steps, each rank on its half of the batch."""
    model = make_model()
    engine = kiln.Engine(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), nn.CrossEntropyLoss(), strategy=strategy
    )
    x, y = make_data(steps, 16)
    rank, size = engine.data_parallel_rank, engine.data_parallel_size
    for step in range(steps):
        xb, yb = x[step * 16 : (step + 1) * 16].chunk(size)[rank], y[step * 16 : (step + 1) * 16].chunk(size)[rank]
        engine.zero_grad()
        engine.backward(engine.criterion(engine(xb), yb))
        engine.step()
    return full_model_state_dict(engine.model)


CASES = {
    "ddp": lambda: recording(DDP),
    "zero1": lambda: recording(Zero1),
    "zero3": lambda: recording(Zero3),
    "tp": lambda: recording(TensorParallel, PLAN),
    "hybrid_tp": lambda: recording(Hybrid, tp=2, tp_plan=PLAN),
    "hybrid_fsdp": lambda: recording(Hybrid, dp_shard=2),
    "pp": lambda: recording(Pipeline, ["blocks.2"], microbatches=2),
    "root_only_fsdp": lambda: recording(RootOnlyFSDP),
}


def main():
    out = sys.argv[1]
    ctx = kiln.launch_from_torch(seed=0)
    results = {}
    for name, make in CASES.items():
        mine = facts(make())
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, mine)
        results[name] = everyone
    # the overridden step trains like the one it replaced
    a, b = train(RootOnlyFSDP()), train(Zero3())
    results["root_only_vs_zero3"] = max((a[k] - b[k]).abs().max().item() for k in a)
    if ctx.rank == 0:
        with open(os.path.join(out, "parallelize.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
