"""Data parallel with torch's DistributedDataParallel."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kiln.parallel.strategy import Strategy

if TYPE_CHECKING:
    from kiln.parallel.transforms.parallelize import ParallelizePlan

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
    steps = ("placement", "float8", "activation_checkpointing", "compile", "data_parallel")

    def __init__(self, **ddp_kwargs: Any) -> None:
        self.ddp_kwargs = ddp_kwargs

    def apply_data_parallel(self, model: nn.Module, plan: ParallelizePlan) -> nn.Module:
        if plan.ctx.world_size == 1:
            return model  # DDP needs a process group; with one rank it would only add a wrapper.
        device_ids = [plan.ctx.device.index] if plan.ctx.device.type == "cuda" else None
        kwargs = {"find_unused_parameters": self.find_unused_parameters, **self.ddp_kwargs}
        return DistributedDataParallel(model, device_ids=device_ids, **kwargs)

    def set_grad_sync(self, model: nn.Module, enabled: bool) -> None:
        # DDP reads this flag in forward() to decide whether backward all-reduces; setting it is
        # what `no_sync()` does, without a context manager around user code (as nanoGPT does).
        if isinstance(model, DistributedDataParallel):
            model.require_backward_grad_sync = enabled

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, **self.ddp_kwargs}
