"""From MosaicML Composer to kiln: the ComposerModel, the Trainer's arguments, callbacks,
algorithms, loggers and checkpoints keep Composer's names.

    kiln run -n 2 examples/migrate/from_composer.py [--save-folder DIR]     (Composer: composer -n 2 train.py)

docs/migrate/composer.md shows both sides. Writes its checkpoints and its JSON-lines log under
``--save-folder`` (default ``runs/from_composer`` in the working directory).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import kiln
from kiln.algorithms import EMA, LabelSmoothing
from kiln.callbacks import LRMonitor, SpeedMonitor
from kiln.loggers import FileLogger
from kiln.metrics import Accuracy
from kiln.optim import CosineAnnealingWithWarmupScheduler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from digits_data import DigitsCNN, digits_datasets  # noqa: E402


# --8<-- [start:model]
class DigitsClassifier(kiln.Model):  # Composer: class DigitsClassifier(ComposerModel)
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


# --8<-- [end:model]


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save-folder", default="runs/from_composer")
    args = parser.parse_args(argv)
    if "RANK" in os.environ:  # Composer's launcher sets up the process group itself; kiln's run does too
        kiln.launch_from_torch(seed=17)

    # --8<-- [start:trainer]
    train_set, test_set = digits_datasets()
    model = DigitsClassifier()
    trainer = kiln.Trainer(
        model=model,
        train_dataloader=kiln.get_dataloader(train_set, shuffle=True, batch_size=32, drop_last=True),
        eval_dataloader=kiln.get_dataloader(test_set, batch_size=128),
        max_duration="6ep",
        optimizers=torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4),
        schedulers=CosineAnnealingWithWarmupScheduler(t_warmup="0.1dur"),
        eval_interval="1ep",
        algorithms=[LabelSmoothing(smoothing=0.1), EMA(half_life="20ba")],
        callbacks=[SpeedMonitor(window_size=10), LRMonitor()],
        loggers=[FileLogger(Path(args.save_folder) / "metrics.jsonl")],
        save_folder=str(Path(args.save_folder) / "checkpoints"),
        save_interval="2ep",
        save_num_checkpoints_to_keep=2,
        progress_bar=False,
        seed=17,
    )
    trainer.fit()
    # --8<-- [end:trainer]
    accuracy = trainer.state.metrics["eval/Accuracy"]
    if trainer.state.is_main:
        print(f"final test accuracy: {accuracy:.4f} after {trainer.state.timestamp.batch.value} batches")
    trainer.close()
    return accuracy


if __name__ == "__main__":
    main()
