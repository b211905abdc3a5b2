"""Loggers: a :class:`Logger` that fans metrics out to destinations (console, file, services).

The service loggers (TensorBoard, W&B, MLflow) import their packages only when built, so
importing ``kiln.loggers`` needs none of them.
"""

from kiln.loggers.console import ConsoleLogger
from kiln.loggers.destination import LoggerDestination
from kiln.loggers.file import FileLogger
from kiln.loggers.logger import Logger
from kiln.loggers.mlflow import MLflowLogger
from kiln.loggers.tensorboard import TensorBoardLogger
from kiln.loggers.wandb import WandBLogger

__all__ = [
    "LoggerDestination",
    "Logger",
    "ConsoleLogger",
    "FileLogger",
    "TensorBoardLogger",
    "WandBLogger",
    "MLflowLogger",
]
