"""One process, one device: move the model there and cast it for the precision."""

from __future__ import annotations

from kiln.parallel.strategy import Strategy

__all__ = ["SingleDevice"]


class SingleDevice(Strategy):
    """No parallelism: the model on ``ctx.device``, cast to the precision's storage dtypes.

    Example::

        engine, *_ = kiln.initialize(model, opt, config={"strategy": "single"})
    """

    name = "single"
    steps = ("placement", "float8", "activation_checkpointing", "compile")
