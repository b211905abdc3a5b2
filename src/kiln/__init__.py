"""kiln: a PyTorch-native training framework with three front doors on one core.

- Engine: ``kiln.initialize(model, optimizer, criterion, ...)`` for a plain loop.
- Trainer: ``kiln.Trainer(model, train_dataloader=..., max_duration="10ep").fit()``.
- Config CLI: ``kiln train -f run.yaml --optimizer.args.lr 0.01``.

Names are resolved lazily so that ``import kiln`` costs little beyond ``import torch``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

# transformers imports torchao whenever it is installed; its import-time warnings about optional
# kernels are kept off runs that never asked for torchao (kiln/_import_noise.py says which and why)
from kiln._import_noise import quiet_torchao_import as _quiet_torchao_import  # noqa: E402

_quiet_torchao_import()

# modules that moved keep their old import paths (kiln/_moved.py says which and why)
from kiln._moved import install as _install_moved  # noqa: E402

_install_moved()

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # launch
    "Config": "kiln.launch.config",
    "Context": "kiln.launch.context",
    "context": "kiln.launch.context",
    "launch_from_torch": "kiln.launch.context",
    "launch_from_slurm": "kiln.launch.context",
    "launch_from_openmpi": "kiln.launch.context",
    "get_default_parser": "kiln.launch.context",
    "seed_everything": "kiln.launch.context",
    "LaunchError": "kiln.launch.environments",
    "get_dist_logger": "kiln.launch.logging",
    "get_dataloader": "kiln.launch.data",
    "ResumableLoader": "kiln.launch.loader",
    # precision and engine
    "AMP_TYPE": "kiln.precision",
    "Precision": "kiln.precision",
    "Engine": "kiln.engine",
    "initialize": "kiln.engine",
    # core types
    "Event": "kiln.core.event",
    "Callback": "kiln.core.callback",
    "Algorithm": "kiln.core.callback",
    "Time": "kiln.core.time",
    "TimeUnit": "kiln.core.time",
    "Timestamp": "kiln.core.time",
    "State": "kiln.core.state",
    "Model": "kiln.core.model",
    # loop
    "Trainer": "kiln.trainer.trainer",
    "Evaluator": "kiln.trainer.evaluator",
    "FaultTolerance": "kiln.trainer.fault_tolerance",
}

_SUBMODULES = {
    "parallel",
    "precision",
    "engine",
    "core",
    "launch",
    "optim",
    "algorithms",
    "callbacks",
    "loggers",
    "metrics",
    "models",
    "hooks",
    "trainer",
    "checkpoint",
    "config",
    "report",
    "cli",
}

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if name in _SUBMODULES:
        module = importlib.import_module(f"kiln.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
