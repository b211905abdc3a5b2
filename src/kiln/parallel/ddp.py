"""Data parallel with torch's DistributedDataParallel."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kiln.parallel.strategy import Strategy

if TYPE_CHECKING:
    from kiln.launch.context import Context
    from kiln.precision import Precision

__all__ = ["DDP"]


class DDP(Strategy):
    """Replicate the model on every rank and all-reduce gradients (``DistributedDataParallel``).

    Args:
        **ddp_kwargs: passed to ``DistributedDataParallel`` (``bucket_cap_mb``,
            ``find_unused_parameters``, ``gradient_as_bucket_view``, ...).

    Example::

        trainer = kiln.Trainer(model, strategy="ddp", ...)
    """

    name = "ddp"

    def __init__(self, **ddp_kwargs: Any) -> None:
        self.ddp_kwargs = ddp_kwargs

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: Context,
              precision: Precision) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        if ctx.world_size == 1:
            # DDP needs a process group; with one rank it would only add a wrapper.
            model.to(ctx.device)
            precision.setup_module(model)
            return model, optimizer
        model.to(ctx.device)
        precision.setup_module(model)
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        kwargs = {"find_unused_parameters": self.find_unused_parameters, **self.ddp_kwargs}
        return DistributedDataParallel(model, device_ids=device_ids, **kwargs), optimizer

    def set_grad_sync(self, model: nn.Module, enabled: bool) -> None:
        # DDP reads this flag in forward() to decide whether backward all-reduces; setting it is
        # what `no_sync()` does, without a context manager around user code (as nanoGPT does).
        if isinstance(model, DistributedDataParallel):
            model.require_backward_grad_sync = enabled

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, **self.ddp_kwargs}
