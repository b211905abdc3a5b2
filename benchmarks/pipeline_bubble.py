"""Bubble fraction of each pipeline schedule: the share of a training step a rank spends not computing.

    python benchmarks/pipeline_bubble.py                      # launches itself on 2 processes (CPU: gloo)
    python benchmarks/pipeline_bubble.py --microbatches 4 --rounds 10 --out result.json

Every schedule trains its own copy of one model (8 residual MLP blocks, 4 per rank: split before
block 4 for the one-stage-per-rank schedules, before blocks 2, 4 and 6 for the two-stage ones) in the
same processes, in short interleaved rounds (gpipe, 1f1b, ... then again), so load from other
programs falls on all of them alike. On each rank the wall time of ``schedule.step`` (forward,
loss and backward of every microbatch) is split into the time inside the stages' compute calls
(``forward_one_chunk``, ``backward_one_chunk``, ``backward_weight_one_chunk``, timed by wrapping
them on the stage objects) and the rest: waiting for a neighbour (the bubble) plus the schedule's
own bookkeeping and the sends and receives. "bubble" is that rest over the step time, the median
over rounds of the mean over ranks.

What it measures on CPU with gloo (be careful reading it): the ranks share the machine's cores
(run it on an otherwise idle machine, one core per rank), a send is a memory copy through a
local socket, and the zero-bubble schedules' split backward (input gradients first, weight
gradients later) runs two autograd passes where the others run one. The theoretical bubble of
GPipe and 1F1B is (p - 1) / (m + p - 1) for p ranks and m microbatches, of interleaved 1F1B with
v stages per rank (p - 1) / (v m + p - 1); ZBV is zero when forward, input-backward and
weight-backward of a stage take the same time (arXiv 2401.10241, section 6).

Reaches into two private attributes to time the stages: kiln's ``PipelineRuntime._schedule`` and
torch's ``_stages`` of a multi-stage schedule (``_stage`` of a single-stage one).
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
SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "interleaved_zb", "zbv", "dualpipev")
COMPUTE = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, dim: int, hidden: int, num_blocks: int = 8, classes: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(num_blocks))
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def theory(schedule: str, p: int, m: int) -> float | None:
    """The textbook bubble fraction with equal stage times (None: depends on F/B/W times)."""
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved1f1b":
        return (p - 1) / (2 * m + p - 1)
    if schedule == "zbv":
        return 0.0
    return None


class Timed:
    """Wraps the stages' compute calls and the schedule's step of one engine to time them."""

    def __init__(self, engine) -> None:
        schedule = engine.strategy.pipeline._schedule
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        self.compute = self.step = 0.0
        for stage in stages:
            for name in COMPUTE:
                if hasattr(stage, name):
                    setattr(stage, name, self._wrap(getattr(stage, name), "compute"))
        schedule.step = self._wrap(schedule.step, "step")

    def _wrap(self, fn, field):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - start)

        return timed


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import kiln
    from kiln.parallel import Pipeline

    ctx = kiln.launch_from_torch(seed=0)
    p = ctx.world_size
    one = [f"blocks.{4 * r}" for r in range(1, p)]  # one stage per rank: 8 / p blocks each
    two = [f"blocks.{2 * r}" for r in range(1, 2 * p)]  # two stages per rank: 2 blocks each
    batch = args.microbatches * args.rows
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, args.dim, generator=g)
    y = torch.randint(0, 16, (batch,), generator=g)
    engines, timers = {}, {}
    for name in args.schedules.split(","):
        torch.manual_seed(0)
        model = Net(args.dim, args.hidden, num_blocks=4 * p)
        splits = one if name in ("gpipe", "1f1b") else two
        strategy = Pipeline(splits, schedule=name, microbatches=args.microbatches)
        engine = kiln.Engine(
            model, torch.optim.SGD(model.parameters(), lr=1e-3), nn.CrossEntropyLoss(), strategy=strategy
        )
        engine.backward(engine.criterion(engine(x), y))  # builds the stages (traced once)
        engine.step()
        engines[name], timers[name] = engine, Timed(engine)
    bubbles: dict[str, list[float]] = {name: [] for name in engines}
    steps: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            timer = timers[name]
            timer.compute = timer.step = 0.0
            dist.barrier()
            for _ in range(args.steps):
                engine.zero_grad()
                engine.backward(engine.criterion(engine(x), y))
                engine.step()
            mine = torch.tensor([timer.step, timer.compute], dtype=torch.float64)
            every = [torch.zeros_like(mine) for _ in range(p)]
            dist.all_gather(every, mine)
            bubbles[name].append(statistics.mean(1 - float(c) / float(s) for s, c in every))
            steps[name].append(statistics.mean(float(s) for s, _ in every) / args.steps)
    if ctx.rank == 0:
        result = {
            "ranks": p,
            "microbatches": args.microbatches,
            "rows_per_microbatch": args.rows,
            "dim": args.dim,
            "hidden": args.hidden,
            "rounds": args.rounds,
            "load_average": os.getloadavg(),
            "torch": torch.__version__,
            "schedules": {
                name: {
                    "bubble": statistics.median(bubbles[name]),
                    "step_ms": 1e3 * statistics.median(steps[name]),
                    "theory": theory(name, p, args.microbatches),
                }
                for name in engines
            },
        }
        print(f"{'schedule':<16} {'bubble':>7} {'theory':>7} {'step ms':>8}")
        for name, r in result["schedules"].items():
            t = "-" if r["theory"] is None else f"{r['theory']:.2f}"
            print(f"{name:<16} {r['bubble']:>7.2f} {t:>7} {r['step_ms']:>8.1f}")
        print(f"load average {result['load_average'][0]:.2f}")
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--rows", type=int, default=16, help="rows per microbatch")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--steps", type=int, default=2, help="steps per schedule per round")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--out", default=None, help="write the result as JSON here")
    args, _ = p.parse_known_args()
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
