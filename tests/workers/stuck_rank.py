"""2 ranks; rank 1 stops at batch 5 (asleep) and never comes back.

Usage: stuck_rank.py TIMEOUT trainer|engine under ``kiln run -n 2``. ``trainer``: a Trainer whose
callback sleeps at BATCH_START; ``engine``: a plain Engine loop that sleeps before its fifth step.
Rank 0 waits in the next collective until ``launch_from_torch(timeout=TIMEOUT)`` runs out, then fails
naming rank 1 and each rank's last event; torchrun then stops rank 1.
"""

import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import kiln


def stop(rank, batch):
    if rank == 1 and batch == 5:
        print("rank 1 stops at batch 5", flush=True)
        time.sleep(300)


class Stall(kiln.Callback):
    def batch_start(self, state, logger):
        stop(state.rank, state.timestamp.batch.value + 1)


if __name__ == "__main__":
    ctx = kiln.launch_from_torch(timeout=float(sys.argv[1]))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    data = DataLoader(TensorDataset(x, x[:, :2].argmax(1)), batch_size=8)
    net = nn.Linear(8, 2)
    if sys.argv[2] == "trainer":
        trainer = kiln.Trainer(
            net,
            train_dataloader=data,
            max_duration="2ep",
            criterion=nn.CrossEntropyLoss(),
            progress_bar=False,
            optimizers=torch.optim.SGD(net.parameters(), lr=0.1),
            callbacks=[Stall()],
        )
        trainer.fit()
    else:
        engine, data, *_ = kiln.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), data)
        for batch, (inputs, targets) in enumerate(data, start=1):
            stop(ctx.rank, batch)
            engine.zero_grad()
            engine.backward(engine.criterion(engine(inputs), targets))
            engine.step()
