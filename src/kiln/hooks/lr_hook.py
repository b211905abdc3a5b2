"""`LRSchedulerHook`: steps an LR scheduler per epoch or per iteration."""

from __future__ import annotations

from typing import Any

from kiln.hooks.base import BaseHook
from kiln.hooks.metrics import LearningRateMetric

__all__ = ["LRSchedulerHook"]


class LRSchedulerHook(BaseHook):
    """Step ``lr_scheduler`` after each training epoch (``by_epoch=True``) or iteration.

    Args:
        lr_scheduler: a torch LR scheduler (e.g. ``kiln.optim.CosineAnnealingLR``).
        by_epoch: step per epoch rather than per iteration.
        store_lr_in_state: keep the LR as metric ``LR`` in ``trainer.states['metrics']['train']``.

    Example::

        kiln.hooks.LRSchedulerHook(lr_scheduler=lr_scheduler, by_epoch=True)
    """

    def __init__(self, lr_scheduler: Any, by_epoch: bool, store_lr_in_state: bool = True, priority: int = 1) -> None:
        super().__init__(priority)
        self.lr_scheduler = lr_scheduler
        self.by_epoch = by_epoch
        self.store_lr_in_state = store_lr_in_state
        self.metric = LearningRateMetric(lr_scheduler.get_last_lr()[0])

    def after_hook_is_attached(self, trainer: Any) -> None:
        if self.store_lr_in_state:
            trainer.states.setdefault("metrics", {"train": {}, "test": {}})["train"]["LR"] = self.metric

    def after_train_epoch(self, trainer: Any) -> None:
        if self.by_epoch:
            self.lr_scheduler.step()
            self.metric.update(self.lr_scheduler.get_last_lr()[0])

    def after_train_iter(self, trainer: Any, output: Any, label: Any, loss: Any) -> None:
        if not self.by_epoch:
            self.lr_scheduler.step()
            self.metric.update(self.lr_scheduler.get_last_lr()[0])
