"""The Colossal-AI trainer walk-through (steps 1-4 and 6) on scikit-learn's digits data set.

    kiln run -n 2 examples/trainer_digits.py

Same components as engine_digits.py; the loop is ``kiln.Trainer(engine=..., logger=...)`` with
Colossal-AI's hooks.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

import kiln
from kiln import hooks
from kiln.metrics import Accuracy
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
    config = Path(__file__).with_name("digits_config.py")
    ctx = (
        kiln.launch_from_torch(config=config, seed=42) if "RANK" in os.environ else kiln.launch(config=config, seed=42)
    )
    cfg = ctx.config
    epochs = args.epochs or cfg.NUM_EPOCHS
    logger = kiln.get_dist_logger()

    train_set, test_set = digits_datasets()
    model = DigitsCNN()
    train_dataloader = kiln.get_dataloader(train_set, shuffle=True, batch_size=cfg.BATCH_SIZE, drop_last=True)
    test_dataloader = kiln.get_dataloader(test_set, add_sampler=False, batch_size=256)
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.LEARNING_RATE, momentum=0.9, weight_decay=5e-4)
    lr_scheduler = CosineAnnealingLR(optimizer, total_steps=epochs)

    engine, train_dataloader, test_dataloader, _ = kiln.initialize(
        model, optimizer, criterion, train_dataloader, test_dataloader
    )

    # Step 6: train with the trainer and its hooks.
    trainer = kiln.Trainer(engine=engine, logger=logger)
    accuracy = Accuracy()
    hook_list = [
        hooks.LossHook(),
        hooks.LRSchedulerHook(lr_scheduler=lr_scheduler, by_epoch=True),
        hooks.AccuracyHook(accuracy_func=accuracy),
        hooks.LogMetricByEpochHook(logger),
        hooks.LogMemoryByEpochHook(logger),
    ]
    trainer.fit(
        train_dataloader=train_dataloader,
        epochs=epochs,
        test_dataloader=test_dataloader,
        test_interval=1,
        hooks=hook_list,
        display_progress=True,
    )
    final = trainer.states["metrics"]["test"]["Accuracy"].get_accumulated_value()
    logger.info(f"final test accuracy: {final:.4f}", ranks=[0])
    return final


if __name__ == "__main__":
    main()
