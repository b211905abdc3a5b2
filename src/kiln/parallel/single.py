"""One process, one device: move the model there and cast it for the precision."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kiln.parallel.strategy import Strategy

if TYPE_CHECKING:
    from kiln.launch.context import Context
    from kiln.precision import Precision

__all__ = ["SingleDevice"]


class SingleDevice(Strategy):
    """No parallelism: the model on ``ctx.device``.

    Example::

        engine, *_ = kiln.initialize(model, opt, config={"strategy": "single"})
    """

    name = "single"

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: Context,
              precision: Precision) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        # Module.to and the precision cast replace tensor data in place, so the optimizer's
        # references to the Parameter objects stay valid.
        model.to(ctx.device)
        precision.setup_module(model)
        return model, optimizer
