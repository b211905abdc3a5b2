"""2-rank Trainer: (1) eval metrics on sharded data, written for comparison with one process;
(2) a fit in which rank 1's loss turns NaN at batch 3: NaNMonitor must stop both ranks there."""

import json
import math
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import kiln
from kiln import callbacks, metrics


def data(n=61):  # odd: the ranks' eval shards are uneven
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    return TensorDataset(x, x[:, :4].argmax(1))


def model():
    torch.manual_seed(0)
    return nn.Linear(16, 4)


def eval_trainer(net):
    return kiln.Trainer(
        net,
        criterion=nn.CrossEntropyLoss(),
        progress_bar=False,
        eval_metrics={"Accuracy": metrics.Accuracy(), "CrossEntropy": metrics.CrossEntropy()},
    )


class PoisonLoss(kiln.Callback):
    """Make this rank's loss NaN at one batch (1-based, as the timestamp will count it)."""

    def __init__(self, rank, batch):
        self.rank, self.batch = rank, batch

    def after_loss(self, state, logger):
        if state.rank == self.rank and state.timestamp.batch.value + 1 == self.batch:
            state.loss = state.loss * math.nan


if __name__ == "__main__":
    out = sys.argv[1]
    ctx = kiln.launch_from_torch()
    result = {"eval": eval_trainer(model()).eval(DataLoader(data(), batch_size=8))}
    net = model()
    trainer = kiln.Trainer(
        net,
        train_dataloader=DataLoader(data(64), batch_size=8),
        max_duration="2ep",
        criterion=nn.CrossEntropyLoss(),
        progress_bar=False,
        optimizers=torch.optim.SGD(net.parameters(), lr=0.1),
        callbacks=[PoisonLoss(rank=1, batch=3), callbacks.NaNMonitor(raise_error=False)],
    )
    trainer.fit()
    result["stop_reason"] = trainer.state.stop_reason
    result["batch"] = trainer.state.timestamp.batch.value
    with open(f"{out}/rank{ctx.rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
