"""Configuration: YAML files, dotted command-line overrides and typed ``TrainerArgs`` (nnScaler style).

Example::

    from kiln.config import build_trainer, load_trainer_args
    args = load_trainer_args("examples/mlp.yaml", ["--max_train_steps", "5"], world_size=1)
    build_trainer(args).fit()

Names that need torch (``build_trainer``, ``AggregatedOutputs``, ``TrainHook``) load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from kiln.config.args import TrainerArgs, dump_yaml, load_trainer_args, typed_overrides
from kiln.config.components import (
    CheckpointConfig,
    CriterionConfig,
    DataloaderConfig,
    DatasetConfig,
    DatasetSamplerConfig,
    HookConfig,
    HookMapConfig,
    LogConfig,
    LRSchedulerConfig,
    ModelConfig,
    OptimizerConfig,
)
from kiln.config.compute import ComputeConfig
from kiln.config.overrides import ConfigError

_LAZY = {
    "build_trainer": "kiln.config.trainer_builder",
    "build_model": "kiln.config.trainer_builder",
    "build_precision": "kiln.config.trainer_builder",
    "check_components": "kiln.config.preflight",
    "AggregatedOutputs": "kiln.config.reduction",
    "GradReduction": "kiln.config.reduction",
    "TrainHook": "kiln.config.hooks",
    "HookCallback": "kiln.config.hooks",
}

__all__ = [
    "CheckpointConfig",
    "ComputeConfig",
    "ConfigError",
    "CriterionConfig",
    "DataloaderConfig",
    "DatasetConfig",
    "DatasetSamplerConfig",
    "HookConfig",
    "HookMapConfig",
    "LRSchedulerConfig",
    "LogConfig",
    "ModelConfig",
    "OptimizerConfig",
    "TrainerArgs",
    "dump_yaml",
    "load_trainer_args",
    "typed_overrides",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kiln.config' has no attribute {name!r}")
