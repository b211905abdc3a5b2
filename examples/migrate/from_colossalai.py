"""From Colossal-AI's legacy Engine and Trainer (the ResNet/CIFAR10 walk-through) to kiln.

    kiln run -n 2 examples/migrate/from_colossalai.py     (Colossal-AI: torchrun --nproc_per_node 2 train.py)

The config file (colossalai_config.py), ``launch_from_torch``, ``get_dist_logger``,
``get_dataloader``, ``initialize``, ``Trainer(engine=, logger=)`` and the hooks keep their
Colossal-AI names: the port is ``import colossalai`` -> ``import kiln`` and the hook imports.
docs/migrate/colossalai.md shows both sides.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

import kiln
from kiln import hooks
from kiln.metrics import Accuracy
from kiln.optim import CosineAnnealingLR

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from digits_data import DigitsCNN, digits_datasets  # noqa: E402


# --8<-- [start:hook]
class EpochLossHook(hooks.BaseHook):
    """A user hook, as in Colossal-AI: remembers the mean training loss of every epoch."""

    def __init__(self, priority: int = 10) -> None:
        super().__init__(priority)
        self.epoch_losses: list[float] = []
        self._sum = self._count = 0.0

    def before_train_epoch(self, trainer) -> None:
        self._sum = self._count = 0.0

    def after_train_iter(self, trainer, output, label, loss) -> None:
        self._sum += float(loss)
        self._count += 1

    def after_train_epoch(self, trainer) -> None:
        self.epoch_losses.append(self._sum / max(self._count, 1))


# --8<-- [end:hook]


# --8<-- [start:main]
def main() -> float:
    config = Path(__file__).with_name("colossalai_config.py")
    # Colossal-AI: colossalai.launch_from_torch(config=args.config)
    if "RANK" in os.environ:
        kiln.launch_from_torch(config=config, seed=42)
    else:
        kiln.launch(config=config, seed=42)
    cfg = kiln.context().config  # Colossal-AI: gpc.config
    logger = kiln.get_dist_logger()

    train_set, test_set = digits_datasets()
    model = DigitsCNN()
    train_dataloader = kiln.get_dataloader(train_set, shuffle=True, batch_size=cfg.BATCH_SIZE, drop_last=True)
    test_dataloader = kiln.get_dataloader(test_set, add_sampler=False, batch_size=256)
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.LEARNING_RATE, momentum=0.9, weight_decay=5e-4)
    lr_scheduler = CosineAnnealingLR(optimizer, total_steps=cfg.NUM_EPOCHS)

    engine, train_dataloader, test_dataloader, _ = kiln.initialize(
        model, optimizer, criterion, train_dataloader, test_dataloader
    )

    trainer = kiln.Trainer(engine=engine, logger=logger)
    epoch_losses = EpochLossHook()
    hook_list = [
        hooks.LossHook(),
        hooks.LRSchedulerHook(lr_scheduler=lr_scheduler, by_epoch=True),
        hooks.AccuracyHook(accuracy_func=Accuracy()),
        hooks.LogMetricByEpochHook(logger),
        epoch_losses,
    ]
    trainer.fit(
        train_dataloader=train_dataloader,
        epochs=cfg.NUM_EPOCHS,
        test_dataloader=test_dataloader,
        test_interval=1,
        hooks=hook_list,
        display_progress=False,
    )
    accuracy = trainer.states["metrics"]["test"]["Accuracy"].get_accumulated_value()
    losses = ", ".join(f"{loss:.4f}" for loss in epoch_losses.epoch_losses)
    logger.info(f"precision {engine.precision.name}, epoch losses: {losses}", ranks=[0])
    logger.info(f"final test accuracy: {accuracy:.4f}", ranks=[0])
    return accuracy


# --8<-- [end:main]


if __name__ == "__main__":
    main()
