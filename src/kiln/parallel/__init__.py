"""Parallel strategies on torch.distributed, one file each.

single, ddp, zero1 (ZeroRedundancyOptimizer), zero2/zero3/fsdp (FSDP2), tp (DTensor tensor
parallel), pp (torch.distributed.pipelining), hybrid (a DeviceMesh of them), deepspeed, and auto
(:mod:`kiln.cost.auto`, which estimates, then is one of them). Strategy classes are imported on
first use, so ``import kiln.parallel`` stays cheap.

The rooms beneath, from the ground up: ``state/`` (meshes, DCP state dicts, gradient norms),
``transforms/`` (the model transformations strategies apply, in torchtitan's order), ``pipelining/``
(pipeline runtime, schedules, stage boundary, tracing). ``strategy.py`` is the interface and the
registry; it imports no strategy. Planning (estimates, search, dry run) lives in :mod:`kiln.cost`
and :mod:`kiln.planning`, above this package.
"""

from __future__ import annotations

import importlib
from typing import Any

from kiln.parallel.state.state_dict import full_model_state_dict as full_model_state_dict
from kiln.parallel.strategy import _BUILTIN
from kiln.parallel.strategy import Strategy as Strategy
from kiln.parallel.strategy import get_strategy as get_strategy
from kiln.parallel.strategy import register_strategy as register_strategy
from kiln.parallel.strategy import strategy_names as strategy_names

# public name -> module that defines it: every strategy class of the registry (strategy.py, the
# one list of them), then the other public names.
_LAZY = {
    **{cls: module for module, _, cls in (path.partition(":") for path in _BUILTIN.values())},
    "PipelineOutput": "kiln.parallel.pipeline",
    "full_pipeline_state_dict": "kiln.parallel.pipeline",
    "ParallelDims": "kiln.parallel.state.mesh",
    "ParallelizeOptions": "kiln.parallel.transforms.parallelize",
    "PlanRow": "kiln.cost.memory",
    "plan_table": "kiln.cost.memory",
    "clip_grad_norm_": "kiln.parallel.state.grad_norm",
    "get_state_dict": "kiln.parallel.state.dcp_state",
    "set_state_dict": "kiln.parallel.state.dcp_state",
    "model_state_dict": "kiln.parallel.state.dcp_state",
    "optimizer_state_dict": "kiln.parallel.state.dcp_state",
}

__all__ = sorted(["Strategy", "full_model_state_dict", "get_strategy", "register_strategy", "strategy_names", *_LAZY])


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kiln.parallel' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
