"""A job to stop or break under ``kiln run``, for tests/test_run_stop.py.

Usage: ``stop_worker.py MODE [OUT]``

* ``loop``: a step with an all-reduce forever; each rank writes ``started RANK PID`` once.
* ``boom``: rank 1 raises ``RuntimeError("boom")`` at step 2 while rank 0 waits for it in the
  step's all-reduce.
* ``node``: the rank on node 1 (torchrun's ``GROUP_RANK``) raises at step 2 (multi-node jobs).
* ``trainer OUT``: a Trainer that checkpoints into ``OUT/ckpt`` every batch, for ever; rank 0
  writes ``saved`` once two checkpoints exist.

Lines go out with one ``os.write`` each: the test kills these processes, and a kill between a
line's text and its newline would glue it to the next one.

The modes but ``trainer`` step with a plain all-reduce, not DDP: what the launcher does when a
worker is stopped or fails is the same, and building DDP imports torch._dynamo (~3 CPU-s a rank).
"""

import os
import sys
import time

import torch
from torch import nn

import kiln

mode = sys.argv[1]
ctx = kiln.launch_from_torch(timeout=60)


def say(text: str) -> None:
    os.write(1, f"{text}\n".encode())


if mode == "trainer":

    class Announce(kiln.Callback):
        def batch_checkpoint(self, state, logger):
            if ctx.rank == 0 and state.timestamp.batch.value == 3:
                say("saved")

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    model = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 2))
    trainer = kiln.Trainer(
        model,
        train_dataloader=torch.utils.data.DataLoader(data, batch_size=4),
        max_duration="1000ep",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-3),
        criterion=nn.CrossEntropyLoss(),
        callbacks=[Announce()],
        save_folder=f"{sys.argv[2]}/ckpt",
        save_interval="1ba",
        progress_bar=False,
    )
    trainer.fit()
else:
    failing = (mode == "boom" and ctx.rank == 1) or (mode == "node" and os.environ.get("GROUP_RANK") == "1")
    say(f"started {ctx.rank} {os.getpid()}")
    step = 0
    while True:
        if step == 2 and failing:
            raise RuntimeError("boom")  # BOOM_LINE
        torch.distributed.all_reduce(torch.randn(4))  # the others wait here for the rank that failed
        step += 1
        time.sleep(0.05)
