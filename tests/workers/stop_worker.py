"""A job to stop or break under ``kiln run``, for tests/test_run_stop.py.

Usage: ``stop_worker.py MODE [OUT]``

* ``loop``: DDP steps forever; each rank writes ``started RANK PID`` once.
* ``boom``: rank 1 raises ``RuntimeError("boom")`` in forward at step 2 while rank 0 waits for it
  in backward's all-reduce.
* ``node``: the rank on node 1 (torchrun's ``GROUP_RANK``) raises at step 2 (multi-node jobs).
* ``trainer OUT``: a Trainer that checkpoints into ``OUT/ckpt`` every batch, for ever; rank 0
  writes ``saved`` once two checkpoints exist.

Lines go out with one ``os.write`` each: the test kills these processes, and a kill between a
line's text and its newline would glue it to the next one.
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


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.step == 2 and (
            (mode == "boom" and ctx.rank == 1) or (mode == "node" and os.environ.get("GROUP_RANK") == "1")
        ):
            raise RuntimeError("boom")  # BOOM_LINE
        return self.lin(x)


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
    net = Net()
    model = nn.parallel.DistributedDataParallel(net)
    say(f"started {ctx.rank} {os.getpid()}")
    while True:
        model(torch.randn(2, 4)).sum().backward()
        net.step += 1
        time.sleep(0.05)
