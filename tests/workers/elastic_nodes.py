"""A Trainer job for the multi-node drills (tests/test_multinode.py), started by one `kiln run` per
'node'. Every rank appends one JSON line per batch to OUT/steps.jsonl (one os.write each: a
killed process leaves whole lines), with its node, rank, world size, batch, loss and time.

--kill-agent-at N (given to one node's launcher): on the first pass past batch N (before the next
batch's fetch: batch N's goodput record is written), the rank SIGKILLs its own `kiln run` (the
node's agent dies; the parent-death signal takes the worker with it).
--hold-at N: while the world has one rank, wait at the end of batch N until a SIGTERM comes (the
agent stopping the worker group to take a returning node in; at most 120 s), after a "hold" line
that tells the test to start that node. The Trainer's preemption handler then checkpoints batch N.
The goodput account (OUT/ckpt.goodput.json) is written at every step: the test reads its last records.
--then ARGS...: then `kiln ARGS` in the same ranks and process group (a second job of one launch)."""

import argparse
import json
import os
import signal
import time

import torch
from torch import nn

import kiln
from kiln.trainer.goodput import GoodputMonitor

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--kill-agent-at", type=int, default=None)
parser.add_argument("--hold-at", type=int, default=None)
parser.add_argument("--duration", default="16ba")
# --then ARGS...: once this job has ended, the same ranks run `kiln ARGS` (kiln's config CLI, say) in
# the same process group: a second job for the price of no second launch
parser.add_argument("--then", nargs=argparse.REMAINDER, default=None)
opts = parser.parse_args()

ctx = kiln.launch_from_torch()
node = int(os.environ.get("GROUP_RANK", 0))
g = torch.Generator().manual_seed(0)
x = torch.randn(96, 8, generator=g)
data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 2))
log = os.open(os.path.join(opts.out, "steps.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)


def line(**fields):
    os.write(log, (json.dumps({"node": node, "rank": ctx.rank, "world": ctx.world_size, **fields}) + "\n").encode())


class Drill(kiln.Callback):
    def batch_end(self, state, logger):
        batch = state.timestamp.batch.value
        line(batch=batch, loss=state.loss.item(), time=time.time())
        if ctx.world_size == 1 and batch == opts.hold_at:
            hold(batch)

    def before_dataloader(self, state, logger):
        batch = state.timestamp.batch.value
        marker = os.path.join(opts.out, "killed")
        if (
            opts.kill_agent_at is not None
            and ctx.world_size == 2
            and batch >= opts.kill_agent_at
            and not os.path.exists(marker)
        ):
            open(marker, "w").close()
            line(event="kill", time=time.time())
            os.kill(os.getppid(), signal.SIGKILL)
            time.sleep(60)  # the parent-death signal ends this process


def hold(batch):
    stopping = []
    previous = signal.getsignal(signal.SIGTERM)  # the Trainer's preemption handler

    def note(signum, frame):
        stopping.append(signum)
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGTERM, note)
    line(event="hold", batch=batch, time=time.time())
    deadline = time.monotonic() + 120
    while not stopping and time.monotonic() < deadline:
        time.sleep(0.02)
    signal.signal(signal.SIGTERM, previous)


trainer = kiln.Trainer(
    model,
    train_dataloader=torch.utils.data.DataLoader(data, batch_size=4, shuffle=True),
    max_duration=opts.duration,
    optimizers=torch.optim.AdamW(model.parameters(), lr=0.01),
    criterion=nn.CrossEntropyLoss(),
    callbacks=[Drill()],
    save_folder=os.path.join(opts.out, "ckpt"),
    save_interval="2ba",
    autoresume=True,
    seed=3,
    progress_bar=False,
    goodput=GoodputMonitor(interval=0),
)
line(event="start", batch=trainer.state.timestamp.batch.value, time=time.time())
trainer.fit()
weights = kiln.parallel.full_model_state_dict(trainer.engine.model)
line(event="end", weights={k: v.tolist() for k, v in weights.items()})
if opts.then:
    import kiln.cli.main

    trainer.close()
    os.close(log)
    code = kiln.cli.main.main(opts.then)
    if code:
        raise SystemExit(code)
if torch.distributed.is_initialized():  # a world of one has no group
    torch.distributed.destroy_process_group()
