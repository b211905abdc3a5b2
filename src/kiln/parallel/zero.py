"""ZeRO stage 1: DDP for gradients, torch's ``ZeroRedundancyOptimizer`` for the optimizer state."""

from __future__ import annotations

import inspect
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kiln.parallel.ddp import DDP

if TYPE_CHECKING:
    from kiln.launch.context import Context
    from kiln.precision import Precision

__all__ = ["Zero1"]


class Zero1(DDP):
    """Replicated parameters and gradients, optimizer state sharded over the ranks.

    Each rank steps the optimizer for its share of the parameters and broadcasts the result, so the
    optimizer state (Adam's two moments: twice the parameters) is divided by the world size while
    the communication stays that of DDP plus one broadcast of the parameters.

    The user's optimizer is rebuilt as ``ZeroRedundancyOptimizer(param_groups,
    optimizer_class=type(optimizer), **optimizer.defaults)``; use the optimizer the Engine holds
    (``engine.optimizer``) from then on. Its param groups are the user's own dicts, so an LR scheduler
    built on the original optimizer still sets the learning rate.

    Args:
        parameters_as_bucket_view: ``ZeroRedundancyOptimizer`` packs each rank's parameters in
            one flat buffer per device (faster broadcasts, one extra copy of the parameters).
        **ddp_kwargs: passed to ``DistributedDataParallel``.

    Example::

        engine, *_ = kiln.initialize(model, torch.optim.AdamW(model.parameters()), config={"strategy": "zero1"})
    """

    name = "zero1"

    def __init__(self, *, parameters_as_bucket_view: bool = False, **ddp_kwargs: Any) -> None:
        super().__init__(**ddp_kwargs)
        self.parameters_as_bucket_view = parameters_as_bucket_view

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: Context, precision: Precision
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        if optimizer is not None and any(optimizer.state.values()):
            raise ValueError(
                "strategy='zero1' got an optimizer that already has state (it has stepped); "
                "create the Engine/Trainer before the first optimizer step"
            )
        model, optimizer = super().setup(model, optimizer, ctx, precision)
        if ctx.world_size == 1 or optimizer is None:
            return model, optimizer
        return model, shard_optimizer(optimizer, self.parameters_as_bucket_view)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "parameters_as_bucket_view": self.parameters_as_bucket_view}


def _constructor_defaults(cls: type[torch.optim.Optimizer], defaults: dict[str, Any]) -> dict[str, Any]:
    # `defaults` may hold keys the constructor does not take (AdamW inherits Adam's
    # "decoupled_weight_decay" default but fixes it itself): keep the ones it accepts.
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


def shard_optimizer(optimizer: torch.optim.Optimizer, parameters_as_bucket_view: bool = False) -> torch.optim.Optimizer:
    """``optimizer`` as a ``ZeroRedundancyOptimizer`` of the same class, groups and hyperparameters."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    cls = type(optimizer)
    groups = [dict(group) for group in optimizer.param_groups]
    zero = ZeroRedundancyOptimizer(
        groups,
        optimizer_class=cls,
        parameters_as_bucket_view=parameters_as_bucket_view,
        **_constructor_defaults(cls, optimizer.defaults),
    )
    # ZeroRedundancyOptimizer copies every group's hyperparameters (not "params") into its local
    # optimizer before each step. Sharing the user's group dicts, which hold the same parameters in
    # the same order, keeps an LR scheduler built on the user's optimizer in charge of the rate.
    zero.param_groups = optimizer.param_groups
    # Such a scheduler also checks, at its first step, that the user's optimizer stepped before it
    # (torch marks that in a wrapper of the user's step, which ZeRO never calls): mark it from ZeRO's.
    zero.register_step_post_hook(_marks_stepped(optimizer))
    return zero


def _marks_stepped(optimizer: torch.optim.Optimizer) -> Any:
    user = weakref.ref(optimizer)

    def hook(*_: Any) -> None:
        target = user()
        if target is not None:
            target._opt_called = True  # type: ignore[attr-defined]  # what torch's LRScheduler reads

    return hook
