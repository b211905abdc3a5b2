"""The Trainer under strategy="auto" on 2 ranks, then under the strategy auto chose: rank 0 writes
OUT/auto.json with both runs' losses and the plan's activation bytes per row."""

import json
import sys

import torch
from torch import nn

import kiln

out = sys.argv[1]
ctx = kiln.launch_from_torch()


class Noisy(torch.utils.data.Dataset):
    """Each read draws fresh noise from torch's generator, as an augmentation does."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 8, generator=g)
        self.y = (self.x[:, 0] > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(8), self.y[i]


def run(strategy):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 2))
    losses = []

    class Record(kiln.Callback):
        def batch_end(self, state, logger):
            losses.append(float(state.loss))

    trainer = kiln.Trainer(
        model,
        train_dataloader=torch.utils.data.DataLoader(Noisy(), batch_size=8, shuffle=True),
        max_duration="6ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(),
        strategy=strategy,
        callbacks=[Record()],
        seed=11,
        progress_bar=False,
    )
    trainer.fit()
    return trainer, losses


auto, auto_losses = run("auto")
chosen = auto.engine.strategy.chosen.name
_, plain_losses = run(chosen)
if ctx.rank == 0:
    table = [{"strategy": r.strategy, "activations": r.activations} for r in auto.engine.strategy.table]
    with open(f"{out}/auto.json", "w") as f:
        json.dump({"chosen": chosen, "table": table, "auto": auto_losses, "plain": plain_losses}, f)
