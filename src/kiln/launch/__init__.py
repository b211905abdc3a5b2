"""The launch layer: process groups from torchrun, SLURM, Open MPI or explicit arguments."""

from kiln.launch.config import Config, load_config
from kiln.launch.context import (
    Context,
    context,
    get_default_parser,
    launch,
    launch_from_openmpi,
    launch_from_slurm,
    launch_from_torch,
    seed_everything,
)
from kiln.launch.data import ResumableSampler, ensure_distributed_sampler, get_dataloader
from kiln.launch.environments import LaunchError
from kiln.launch.heartbeat import CollectiveTimeout
from kiln.launch.loader import ResumableLoader
from kiln.launch.logging import DistributedLogger, get_dist_logger
from kiln.launch.streaming import as_stateful_dataloader, shard_by_rank

__all__ = [
    "CollectiveTimeout",
    "Config",
    "Context",
    "DistributedLogger",
    "LaunchError",
    "ResumableLoader",
    "ResumableSampler",
    "as_stateful_dataloader",
    "context",
    "ensure_distributed_sampler",
    "get_dataloader",
    "get_default_parser",
    "get_dist_logger",
    "launch",
    "launch_from_openmpi",
    "launch_from_slurm",
    "launch_from_torch",
    "load_config",
    "seed_everything",
    "shard_by_rank",
]


# `kiln.launch(...)` is the public launch function (DESIGN.md), and `kiln.launch` is also this
# package: importing any submodule binds the package to `kiln.launch`. Making the package
# callable lets both hold without renaming either.
import sys as _sys
import types as _types


class _CallableModule(_types.ModuleType):
    def __call__(self, *args, **kwargs):
        return launch(*args, **kwargs)


_sys.modules[__name__].__class__ = _CallableModule
