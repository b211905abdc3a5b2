"""What the stopping callbacks share: finding a monitored value in ``state.metrics`` and comparing it."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch

from kiln.core.state import State

__all__ = ["metric_key", "read_metric", "comparison", "lower_is_better", "improved"]

# Substrings of metric names whose best value is the smallest (Composer's list, plus common losses).
_LOWER_IS_BETTER = ("loss", "error", "perplexity", "mse", "mae", "crossentropy")

_COMPARISONS: dict[str, Callable[[Any, Any], bool]] = {
    "min": operator.lt,
    "lt": operator.lt,
    "less": operator.lt,
    "<": operator.lt,
    "max": operator.gt,
    "gt": operator.gt,
    "greater": operator.gt,
    ">": operator.gt,
    "le": operator.le,
    "less_equal": operator.le,
    "<=": operator.le,
    "ge": operator.ge,
    "greater_equal": operator.ge,
    ">=": operator.ge,
}


def lower_is_better(monitor: str) -> bool:
    """Whether a metric called ``monitor`` improves downwards (losses, errors, perplexity)."""
    return any(part in monitor.lower() for part in _LOWER_IS_BETTER)


def comparison(comp: str | Callable[[Any, Any], Any] | None, monitor: str, owner: str) -> Callable[[Any, Any], bool]:
    """``comp(value, reference) -> bool`` from a name (``"min"``, ``"gt"``, ``">="``...), a callable or None (auto)."""
    if comp is None:
        return operator.lt if lower_is_better(monitor) else operator.gt
    if callable(comp):
        return lambda value, reference: bool(comp(value, reference))
    if isinstance(comp, str) and comp.lower() in _COMPARISONS:
        return _COMPARISONS[comp.lower()]
    raise ValueError(
        f"{owner}: unknown comparison {comp!r}; use one of {sorted(_COMPARISONS)}, a callable "
        f"comp(value, reference) -> bool, or None to choose from the metric name"
    )


def metric_key(monitor: str, dataloader_label: str) -> str:
    """The ``state.metrics`` key: ``"Accuracy"`` with label ``"eval"`` is ``"eval/Accuracy"``."""
    return monitor if monitor.startswith(f"{dataloader_label}/") else f"{dataloader_label}/{monitor}"


def read_metric(state: State, monitor: str, dataloader_label: str, owner: str) -> float:
    """The latest value of ``monitor`` as a float; a clear error if the Trainer has not recorded it.

    ``monitor`` may be a bare name (``"Accuracy"``, looked up as ``"<label>/Accuracy"``) or the full
    key (``"eval/Accuracy"``). Every rank must take the same stopping decision, or the ranks that
    go on wait for the stopped ones forever: evaluation values in ``state.metrics`` are already
    the same on every rank, while ``train/`` values are each rank's own (the loss of its batch),
    so those are averaged over the ranks here, one collective per check.
    """
    metrics = state.metrics
    for key in (metric_key(monitor, dataloader_label), monitor):
        if key in metrics:
            value = metrics[key]
            if key.startswith("train/") and isinstance(value, torch.Tensor) and getattr(state, "world_size", 1) > 1:
                value = _rank_mean(value)
            return float(value.item() if hasattr(value, "item") else value)
    raise KeyError(
        f"{owner}: no metric {metric_key(monitor, dataloader_label)!r} in state.metrics "
        f"(recorded: {sorted(metrics) or 'none'}); check `monitor` and `dataloader_label`"
    )


def _rank_mean(value: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    total = value.detach().to(torch.float64).clone()
    dist.all_reduce(total)  # a SUM: gloo has no AVG
    return total / dist.get_world_size()


def improved(value: float, best: float | None, better: Callable[[Any, Any], bool], min_delta: float) -> bool:
    """Whether ``value`` beats ``best`` by more than ``min_delta`` (a first or finite-after-NaN value does)."""
    if best is None or (math.isnan(best) and not math.isnan(value)):
        return True
    return better(value, best) and abs(value - best) > min_delta
