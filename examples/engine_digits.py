"""The Colossal-AI engine walk-through (steps 1-5) on scikit-learn's digits data set.

    kiln run -n 2 examples/engine_digits.py

Step 1 is digits_config.py; steps 2-5 are below. Each rank trains on its half of every epoch
(a distributed sampler added by ``get_dataloader``); gradients are all-reduced by DDP.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

import kiln
from kiln.optim import CosineAnnealingLR

sys.path.insert(0, str(Path(__file__).parent))
from digits_data import DigitsCNN, digits_datasets  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # a shorter run than the config's (tests/test_examples.py runs 6 epochs); the schedule spans it
    parser.add_argument("--epochs", type=int, default=None, help="epochs to train (default: the config's NUM_EPOCHS)")
    return parser.parse_args()


def main() -> float:
    args = parse_args()
    # Step 2: initialise the distributed environment (torchrun's variables; a world of 1 otherwise).
    config = Path(__file__).with_name("digits_config.py")
    if "RANK" in os.environ:
        ctx = kiln.launch_from_torch(config=config, seed=42)
    else:
        ctx = kiln.launch(config=config, seed=42)
    cfg = ctx.config
    epochs = args.epochs or cfg.NUM_EPOCHS
    logger = kiln.get_dist_logger()

    # Step 3: build the training components as in any PyTorch script.
    train_set, test_set = digits_datasets()
    model = DigitsCNN()
    train_dataloader = kiln.get_dataloader(train_set, shuffle=True, batch_size=cfg.BATCH_SIZE, drop_last=True)
    test_dataloader = kiln.get_dataloader(test_set, add_sampler=False, batch_size=256)
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.LEARNING_RATE, momentum=0.9, weight_decay=5e-4)
    lr_scheduler = CosineAnnealingLR(optimizer, total_steps=epochs)

    # Step 4: wrap them; the config's fp16 section turns on torch amp with a GradScaler.
    engine, train_dataloader, test_dataloader, _ = kiln.initialize(
        model, optimizer, criterion, train_dataloader, test_dataloader
    )
    logger.info(
        f"training on {ctx.world_size} process(es), precision {engine.precision.name}, strategy {engine.strategy.name}",
        ranks=[0],
    )

    # Step 5: train with the engine.
    start = time.perf_counter()
    accuracy = 0.0
    for epoch in range(epochs):
        train_dataloader.sampler.set_epoch(epoch)
        engine.train()
        for img, label in train_dataloader:
            engine.zero_grad()
            output = engine(img)
            train_loss = engine.criterion(output, label)
            engine.backward(train_loss)
            engine.step()
        lr_scheduler.step()

        engine.eval()
        correct = total = 0
        for img, label in test_dataloader:
            with torch.no_grad():
                output = engine(img)
                test_loss = engine.criterion(output, label)
            correct += int((output.argmax(dim=-1) == label).sum())
            total += img.size(0)
        accuracy = correct / total
        logger.info(
            f"Epoch {epoch} - train loss: {train_loss.item():.5}, test loss: {test_loss.item():.5}, "
            f"acc: {accuracy:.5}, lr: {lr_scheduler.get_last_lr()[0]:.5g}",
            ranks=[0],
        )
    logger.info(f"final test accuracy: {accuracy:.4f} ({time.perf_counter() - start:.1f}s)", ranks=[0])
    return accuracy


if __name__ == "__main__":
    main()
