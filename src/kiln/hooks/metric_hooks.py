"""Hooks that keep metrics in ``trainer.states['metrics']``: loss, accuracy, throughput."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kiln.hooks.base import BaseHook
from kiln.hooks.metrics import AccuracyMetric, HookMetric, LossMetric, ThroughputMetric

__all__ = ["MetricHook", "LossHook", "AccuracyHook", "ThroughputHook"]


class MetricHook(BaseHook):
    """A hook that owns metrics: registers them under ``trainer.states['metrics'][mode][name]`` and
    resets them at the start of each train or test epoch."""

    def __init__(self, priority: int = 0) -> None:
        super().__init__(priority)
        self.train_metrics: dict[str, HookMetric] = {}
        self.test_metrics: dict[str, HookMetric] = {}

    def after_hook_is_attached(self, trainer: Any) -> None:
        trainer.states.setdefault("metrics", {"train": {}, "test": {}})
        trainer.states["metrics"].setdefault("train", {}).update(self.train_metrics)
        trainer.states["metrics"].setdefault("test", {}).update(self.test_metrics)

    def before_train_epoch(self, trainer: Any) -> None:
        for metric in self.train_metrics.values():
            metric.reset()

    def before_test(self, trainer: Any) -> None:
        for metric in self.test_metrics.values():
            metric.reset()


class LossHook(MetricHook):
    """Tracks the mean loss of training and testing epochs as metric ``Loss``.

    Example::

        trainer.fit(..., hooks=[kiln.hooks.LossHook(), kiln.hooks.LogMetricByEpochHook(logger)])
    """

    def __init__(self, priority: int = 0) -> None:
        super().__init__(priority)
        self.train_loss, self.test_loss = LossMetric(), LossMetric()
        self.train_metrics = {"Loss": self.train_loss}
        self.test_metrics = {"Loss": self.test_loss}

    def after_train_iter(self, trainer: Any, output: Any, label: Any, loss: Any) -> None:
        self.train_loss.update(loss)

    def after_test_iter(self, trainer: Any, output: Any, label: Any, loss: Any) -> None:
        self.test_loss.update(loss)


class AccuracyHook(MetricHook):
    """Tracks test accuracy as metric ``Accuracy`` with ``accuracy_func``.

    Args:
        accuracy_func: ``kiln.metrics.Accuracy()`` (a torchmetrics metric) or any callable
            ``(output, label) -> number of correct predictions``.

    Example::

        kiln.hooks.AccuracyHook(accuracy_func=kiln.metrics.Accuracy())
    """

    def __init__(self, accuracy_func: Callable[..., Any], priority: int = 0) -> None:
        super().__init__(priority)
        self.metric = AccuracyMetric(accuracy_func)
        self.test_metrics = {"Accuracy": self.metric}

    def after_test_iter(self, trainer: Any, output: Any, label: Any, loss: Any) -> None:
        self.metric.update(output, label)


class ThroughputHook(MetricHook):
    """Training samples per second (all ranks together) as metric ``Throughput``."""

    def __init__(self, ignored_steps: int = 0, priority: int = 10) -> None:
        super().__init__(priority)
        self.ignored_steps = ignored_steps
        self.metric = ThroughputMetric()
        self.train_metrics = {"Throughput": self.metric}
        self._start = 0.0

    def before_train_iter(self, trainer: Any) -> None:
        self._start = time.perf_counter()

    def after_train_iter(self, trainer: Any, output: Any, label: Any, loss: Any) -> None:
        if trainer.cur_step > self.ignored_steps:
            self.metric.update(label.shape[0], time.perf_counter() - self._start)
