"""The Composer quick tour with kiln's names, on scikit-learn's digits data set.

    kiln run -n 2 examples/composer_style.py      (or: python examples/composer_style.py)

A ``kiln.Model`` owns its forward, loss and metrics; the Trainer takes time strings
(``max_duration="8ep"``, ``eval_interval="1ep"``, warmup ``"0.1dur"``), a time-aware scheduler
stepped every batch, and callbacks.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import kiln
from kiln.callbacks import LRMonitor, SpeedMonitor
from kiln.loggers import ConsoleLogger
from kiln.metrics import Accuracy
from kiln.optim import CosineAnnealingWithWarmupScheduler

sys.path.insert(0, str(Path(__file__).parent))
from digits_data import DigitsCNN, digits_datasets  # noqa: E402


class DigitsClassifier(kiln.Model):
    """The ComposerModel interface: forward(batch), loss(outputs, batch), get_metrics."""

    def __init__(self) -> None:
        super().__init__()
        self.net = DigitsCNN()

    def forward(self, batch):
        inputs, _ = batch
        return self.net(inputs)

    def loss(self, outputs, batch):
        _, targets = batch
        return F.cross_entropy(outputs, targets)

    def get_metrics(self, is_train=False):
        return {"Accuracy": Accuracy()}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # a shorter run (tests/test_examples.py runs 4 epochs); the warmup and cosine span max_duration
    parser.add_argument("--epochs", type=int, default=8, help="epochs to train: max_duration='<epochs>ep' (default 8)")
    return parser.parse_args()


def main() -> float:
    args = parse_args()
    if "RANK" in os.environ:
        kiln.launch_from_torch(seed=17)
    train_set, test_set = digits_datasets()
    model = DigitsClassifier()
    trainer = kiln.Trainer(
        model=model,
        train_dataloader=torch.utils.data.DataLoader(train_set, batch_size=32, shuffle=True, drop_last=True),
        eval_dataloader=torch.utils.data.DataLoader(test_set, batch_size=128),
        optimizers=torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4),
        schedulers=CosineAnnealingWithWarmupScheduler(t_warmup="0.1dur"),
        max_duration=f"{args.epochs}ep",
        eval_interval="1ep",
        callbacks=[SpeedMonitor(window_size=20), LRMonitor()],
        loggers=[ConsoleLogger(log_interval=1000)],  # console: eval results and every 1000th batch
        seed=17,
    )
    trainer.fit()
    accuracy = trainer.state.metrics["eval/Accuracy"]
    if trainer.state.is_main:
        print(f"final test accuracy: {accuracy:.4f} after {trainer.state.timestamp.batch.value} batches")
    trainer.close()
    return accuracy


if __name__ == "__main__":
    main()
