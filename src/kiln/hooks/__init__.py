"""Colossal-AI trainer hooks on kiln's events: ``trainer.fit(..., hooks=[...])``."""

from kiln.hooks.base import BaseHook
from kiln.hooks.log_hooks import (
    LogMemoryByEpochHook,
    LogMetricByEpochHook,
    LogMetricByStepHook,
    LogTimingByEpochHook,
    SaveCheckpointHook,
    TensorboardHook,
)
from kiln.hooks.lr_hook import LRSchedulerHook
from kiln.hooks.metric_hooks import AccuracyHook, LossHook, MetricHook, ThroughputHook

__all__ = [
    "AccuracyHook",
    "BaseHook",
    "LRSchedulerHook",
    "LogMemoryByEpochHook",
    "LogMetricByEpochHook",
    "LogMetricByStepHook",
    "LogTimingByEpochHook",
    "LossHook",
    "MetricHook",
    "SaveCheckpointHook",
    "TensorboardHook",
    "ThroughputHook",
]
