"""From a plain PyTorch DDP loop to kiln's Engine: the same loop, with the setup lines replaced.

    kiln run -n 2 examples/migrate/from_ddp.py          (torchrun --nproc-per-node 2 ... works too)

docs/migrate/ddp.md shows the DDP script this replaces beside it. Each ``# DDP:`` comment names
the line of the plain script that the kiln line below it replaces.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

import kiln

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from digits_data import DigitsCNN, digits_datasets  # noqa: E402


# --8<-- [start:main]
def main(epochs: int = 4) -> float:
    # DDP: dist.init_process_group("gloo"); torch.manual_seed(0); device = ...
    ctx = kiln.launch_from_torch(seed=0) if "RANK" in os.environ else kiln.launch(seed=0)

    train_set, test_set = digits_datasets()
    model = DigitsCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    # DDP: DataLoader(train_set, batch_size=32, sampler=DistributedSampler(train_set, shuffle=True), drop_last=True)
    train_loader = kiln.get_dataloader(train_set, shuffle=True, batch_size=32, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=256)

    # DDP: model = DDP(model.to(device)); inputs moved with .to(device) in the loop
    engine, train_loader, test_loader, _ = kiln.initialize(model, optimizer, criterion, train_loader, test_loader)

    first_loss = last_loss = None
    for epoch in range(epochs):
        train_loader.sampler.set_epoch(epoch)
        engine.train()  # DDP: model.train()
        for inputs, targets in train_loader:
            engine.zero_grad()  # DDP: optimizer.zero_grad()
            loss = engine.criterion(engine(inputs), targets)  # DDP: criterion(model(inputs), targets)
            engine.backward(loss)  # DDP: loss.backward()
            engine.step()  # DDP: optimizer.step()
            first_loss = loss.item() if first_loss is None else first_loss
            last_loss = loss.item()

    engine.eval()
    correct = total = 0
    with torch.no_grad():
        for inputs, targets in test_loader:
            correct += int((engine(inputs).argmax(dim=-1) == targets).sum())
            total += len(targets)
    accuracy = correct / total
    if ctx.is_main:
        print(f"first loss: {first_loss:.4f}, last loss: {last_loss:.4f}")
        print(f"final test accuracy: {accuracy:.4f} on {ctx.world_size} process(es)")
    return accuracy


# --8<-- [end:main]


if __name__ == "__main__":
    main()
