"""A Trainer run for the goodput tests (tests/test_goodput.py): 16 batches, checkpoints every 4.

    goodput_worker.py OUT [--kill-at N] [--item-sleep S]

Every rank appends one JSON line per batch to OUT/steps.jsonl (one os.write each) with the batch,
this process's id and ``time.time()`` at ``BATCH_END``. The goodput account is written at every
step (``GoodputMonitor(interval=0)``) into OUT/ckpt.goodput.json (and goodput/* logged at every record:
``log_interval=0``); autoresume continues from OUT/ckpt.

--kill-at N: once batch N is done (its checkpoint event, and so its record, passed), rank 0
SIGKILLs itself at the next batch's start, as the OOM killer would.
--item-sleep S: the dataset's ``__getitem__`` sleeps S seconds (a slow loader).
"""

import argparse
import json
import os
import signal
import time

import torch
from torch import nn

import kiln
from kiln.loggers import FileLogger
from kiln.trainer.goodput import GoodputMonitor

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--kill-at", type=int, default=None)
parser.add_argument("--item-sleep", type=float, default=0.0)
opts = parser.parse_args()

ctx = kiln.launch_from_torch()
log = os.open(os.path.join(opts.out, "steps.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)


class Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g)

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i):
        if opts.item_sleep:
            time.sleep(opts.item_sleep)
        return self.x[i], self.y[i]


class Drill(kiln.Callback):
    def batch_start(self, state, logger):
        if opts.kill_at is not None and ctx.rank == 0 and state.timestamp.batch.value == opts.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def batch_end(self, state, logger):
        line = {"rank": ctx.rank, "pid": os.getpid(), "batch": state.timestamp.batch.value, "time": time.time()}
        os.write(log, (json.dumps(line) + "\n").encode())


kiln.seed_everything(0)
model = nn.Linear(8, 4)
trainer = kiln.Trainer(
    model,
    train_dataloader=torch.utils.data.DataLoader(Data(), batch_size=4),
    max_duration="16ba",
    optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
    criterion=nn.CrossEntropyLoss(),
    callbacks=[Drill()],
    loggers=[FileLogger(os.path.join(opts.out, "metrics.jsonl"))],
    save_folder=os.path.join(opts.out, "ckpt"),
    save_interval="4ba",
    autoresume=True,
    progress_bar=False,
    goodput=GoodputMonitor(interval=0, log_interval=0),
)
trainer.fit()
