"""Callbacks: objects that watch the training loop and log, monitor or stop it.

Each is a :class:`kiln.Callback` in its own module. ``CheckpointSaver`` (what the Trainer's
``save_folder=`` builds) lives in :mod:`kiln.checkpoint` and is re-exported here on first use, so
importing ``kiln.callbacks`` does not import the checkpoint machinery.

Example::

    from kiln.callbacks import EarlyStopper, LRMonitor, SpeedMonitor
    trainer = kiln.Trainer(model, ..., callbacks=[SpeedMonitor(window_size=50), LRMonitor(),
                                                   EarlyStopper("Accuracy", patience=2)])
"""

from __future__ import annotations

import importlib
from typing import Any

from kiln.callbacks.early_stopper import EarlyStopper
from kiln.callbacks.lr_monitor import LRMonitor
from kiln.callbacks.memory_monitor import MemoryMonitor
from kiln.callbacks.moe_monitor import MoEMonitor
from kiln.callbacks.nan_monitor import NaNMonitor, NonFiniteLossError
from kiln.callbacks.profiler import ProfilerCallback
from kiln.callbacks.speed_monitor import SpeedMonitor
from kiln.callbacks.threshold_stopper import ThresholdStopper

__all__ = [
    "SpeedMonitor",
    "MemoryMonitor",
    "MoEMonitor",
    "LRMonitor",
    "EarlyStopper",
    "ThresholdStopper",
    "NaNMonitor",
    "NonFiniteLossError",
    "ProfilerCallback",
    "CheckpointSaver",
    "HFExport",
]

# imported on first use: CheckpointSaver brings the checkpoint machinery, HFExport the Hugging Face wrapper
_LAZY = {"CheckpointSaver": "kiln.checkpoint", "HFExport": "kiln.callbacks.hf_export"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'kiln.callbacks' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
