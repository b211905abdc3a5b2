"""Forward and loss as the Trainer runs them, for algorithms that need an extra pass (SAM,
SelectiveBackprop) or a second loss (MixUp/CutMix with ``interpolate_loss``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kiln.core.model import Model

if TYPE_CHECKING:
    from kiln.core.state import State

__all__ = ["forward", "compute_loss"]


def forward(state: State, batch: Any) -> Any:
    """``engine(batch)`` for a :class:`kiln.Model`, ``engine(batch[0])`` for a plain module.

    Goes through ``state.engine`` (strategy wrapper, autocast, device moves) when there is one.
    """
    run = state.engine if state.engine is not None else state.model
    return run(batch) if isinstance(state.model, Model) else run(batch[0])


def compute_loss(state: State, outputs: Any, batch: Any) -> Any:
    """``state.loss_fn(outputs, batch)``: the loss function the Trainer uses."""
    loss_fn = getattr(state, "loss_fn", None)
    if loss_fn is not None:
        return loss_fn(outputs, batch)
    # A hand-built State without loss_fn: the model's own loss or the engine's criterion.
    if isinstance(state.model, Model):
        return state.model.loss(outputs, batch)
    if state.engine is not None:
        return state.engine.criterion(outputs, batch[1])
    raise RuntimeError(
        "this algorithm needs the run's loss: set state.loss_fn(outputs, batch) "
        "(the Trainer does), or use a kiln.Model or an Engine with a criterion"
    )
