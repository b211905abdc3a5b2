"""Throughput of each parallel strategy relative to raw torch DDP, and memory per rank.

    python benchmarks/parallel.py                 # launches itself on 2 processes (CPU: gloo)
    python benchmarks/parallel.py --nproc 2 --rounds 40 --out result.json
    python benchmarks/parallel.py --strategies ddp,ds_zero1,ds_zero2,ds_zero3   # DeepSpeed, when installed

Every strategy trains its own copy of one model in the same processes, in short interleaved
rounds (raw DDP, kiln ddp, zero1, ... then again, the order rotated), so load from other programs
on the machine falls on all of them alike; "vs raw DDP" is the median over rounds of the ratio
within a round, samples/s the median over rounds. Throughput is global samples per second
at the same global batch: data-parallel strategies split it over the ranks, tp and pp give every
rank all of it. Memory per rank is what the rank holds after a step: its parameters, gradients and
optimizer state (local shards of DTensors; DDP's communication buckets are not counted).

Targets (issue 6): kiln ddp >= 0.97 x raw DDP; zero3 <= 0.55 x ddp memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, dim: int, hidden: int, num_blocks: int, classes: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(num_blocks))
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _local_bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds (shards count locally)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps this rank's state here
    params = sum(_local_bytes(p) for p in model.parameters())
    grads = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    state = sum(
        _local_bytes(v) for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0
    )  # Adam's 0-d "step" counters aside
    return {"params": params, "grads": grads, "optimizer": state, "total": params + grads + state}


def _deepspeed(stage: int):
    from kiln.parallel.deepspeed import DeepSpeed  # optional: only when a ds_* strategy is asked for

    return DeepSpeed({"zero_optimization": {"stage": stage}, "steps_per_print": 10**9})


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import kiln
    from kiln.parallel import Pipeline, TensorParallel

    ctx = kiln.launch_from_torch(seed=0)
    world = ctx.world_size
    split = f"blocks.{args.blocks // 2}"
    strategies = {
        "ddp": lambda: "ddp",
        "zero1": lambda: "zero1",
        "zero2": lambda: "zero2",
        "zero3": lambda: "zero3",
        "tp": lambda: TensorParallel({"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}),
        "pp": lambda: Pipeline([split], schedule="1f1b", microbatches=4),
        **{f"ds_zero{stage}": (lambda stage=stage: _deepspeed(stage)) for stage in (1, 2, 3)},
    }
    names = [n for n in args.strategies.split(",") if n]
    g = torch.Generator().manual_seed(0)
    x_all = torch.randn(args.global_batch, args.dim, generator=g)
    y_all = torch.randint(0, 16, (args.global_batch,), generator=g)
    per_rank = args.global_batch // world
    local = (
        x_all[ctx.rank * per_rank : (ctx.rank + 1) * per_rank],
        y_all[ctx.rank * per_rank : (ctx.rank + 1) * per_rank],
    )
    criterion = nn.CrossEntropyLoss()

    def make():
        torch.manual_seed(0)
        model = Net(args.dim, args.hidden, args.blocks)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    runners = {}
    model, opt = make()
    raw = DistributedDataParallel(model)

    def raw_step(raw=raw, opt=opt):
        opt.zero_grad(set_to_none=True)
        criterion(raw(local[0]), local[1]).backward()
        opt.step()

    runners["raw_ddp"] = (raw_step, raw, opt)
    for name in names:
        model, opt = make()
        engine = kiln.Engine(model, opt, criterion, strategy=strategies[name]())
        batch = local if engine.data_parallel_size == world else (x_all, y_all)

        def step(engine=engine, batch=batch):
            engine.zero_grad()
            engine.backward(engine.criterion(engine(batch[0]), batch[1]))
            engine.step()

        runners[name] = (step, engine.model, engine.optimizer)

    for step, _, _ in runners.values():  # warm up: first steps build buckets, traces, optimizer state
        for _ in range(2):
            step()
    times: dict[str, list[float]] = {n: [] for n in runners}
    order = list(runners)
    for r in range(args.rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:  # rotated: no one always goes first
            step = runners[name][0]
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            dist.barrier()  # the step is done when the slowest rank is
            times[name].append(time.perf_counter() - start)
    result = {
        "world_size": world,
        "global_batch": args.global_batch,
        "params": sum(p.numel() for p in Net(args.dim, args.hidden, args.blocks).parameters()),
        "strategies": {},
    }
    for name, (_, model, opt) in runners.items():
        t = statistics.median(times[name])
        # each round's ratio compares runs seconds apart, so slow drifts in the machine's load cancel
        ratio = statistics.median(raw / own for raw, own in zip(times["raw_ddp"], times[name]))
        # DeepSpeed keeps its fp32 master partitions and gradients in its own buffers and frees the
        # gradients after the step: not comparable with the count below, so not reported.
        mem = None if name.startswith("ds_") else held_bytes(model, opt)
        gathered = [None] * world
        dist.all_gather_object(gathered, mem and mem["total"])
        result["strategies"][name] = {
            "samples_per_s": args.global_batch * args.steps / t,
            "vs_raw_ddp": ratio,
            "memory_per_rank": mem,
            "memory_max_rank": mem and max(gathered),
        }
    ddp_mem = result["strategies"].get("ddp", result["strategies"]["raw_ddp"])["memory_per_rank"]["total"]
    for entry in result["strategies"].values():
        entry["memory_vs_ddp"] = entry["memory_per_rank"] and entry["memory_per_rank"]["total"] / ddp_mem
    if ctx.rank == 0:
        print(format_result(result))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


def format_result(result: dict) -> str:
    head = (
        f"{result['world_size']} ranks, {result['params'] / 1e6:.2f}M parameters, global batch {result['global_batch']}"
    )
    lines = [
        head,
        f"{'strategy':10} {'samples/s':>10} {'vs raw DDP':>10} {'MiB/rank':>9} {'vs ddp':>7}  (params+grads+optimizer)",
    ]
    for name, r in result["strategies"].items():
        mem = (
            f"{r['memory_per_rank']['total'] / 2**20:9.2f} {r['memory_vs_ddp']:7.3f}"
            if r["memory_per_rank"]
            else f"{'-':>9} {'-':>7}"
        )
        lines.append(f"{name:10} {r['samples_per_s']:10.1f} {r['vs_raw_ddp']:10.3f} {mem}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--strategies", default="ddp,zero1,zero2,zero3,tp,pp")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--global-batch", dest="global_batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=2, help="steps per strategy per round")
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--out", default=None, help="write the result as JSON here")
    args, rest = p.parse_known_args()
    if "RANK" in os.environ:
        worker(args)
        return 0
    # Not under torchrun yet: launch this file on --nproc processes with `kiln run`.
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "kiln.cli.main", "run", "-n", str(args.nproc), __file__, *sys.argv[1:]]
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
