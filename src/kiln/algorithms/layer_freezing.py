"""Layer freezing: stop training the early layers progressively during the second part of a run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from kiln.core.callback import Algorithm
from kiln.core.event import Event

if TYPE_CHECKING:
    from kiln.core.state import State

__all__ = ["LayerFreezing", "freeze_fraction"]


def freeze_fraction(elapsed: float, freeze_start: float, freeze_level: float) -> float:
    """The fraction of layers frozen at ``elapsed`` (a fraction of the run): none before
    ``freeze_start``, then rising linearly to ``freeze_level`` at the end of training."""
    if elapsed < freeze_start:
        return 0.0
    if freeze_start >= 1.0:
        return freeze_level
    return freeze_level * min(1.0, (elapsed - freeze_start) / (1.0 - freeze_start))


def _layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    # Modules that own parameters directly, in registration order: for the usual models that is
    # input to output, which is the order in which freezing is cheapest and least harmful.
    return [(name, m) for name, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]


class LayerFreezing(Algorithm):
    """Freeze the first layers of the model, more of them as training goes on.

    After ``freeze_start`` of the run, at the end of each batch, the first
    ``int(fraction * num_layers)`` layers are frozen (``requires_grad = False``, gradients
    dropped), where ``fraction`` rises linearly from 0 to ``freeze_level`` at the end of training.
    A layer is a module that owns parameters; layers are counted in registration order, taken to be
    input to output. Frozen layers are never unfrozen. The number frozen is in ``state_dict()``
    and reapplied at ``FIT_START`` after a resume, since ``requires_grad`` is not part of a
    checkpoint. Frozen parameters get no gradient, so the optimizer leaves them alone; under DDP
    the strategy must allow unused parameters.

    Events: ``FIT_START``, ``BATCH_END``.

    Args:
        freeze_start: the fraction of training after which freezing begins, in ``[0, 1]``.
        freeze_level: the fraction of layers frozen by the end of training, in ``[0, 1]``.

    Example::

        algorithms = [kiln.algorithms.LayerFreezing(freeze_start=0.5, freeze_level=0.8)]
    """

    find_unused_parameters = True  # skipped or frozen layers get no gradient: DDP must not wait for them

    def __init__(self, freeze_start: float = 0.5, freeze_level: float = 1.0) -> None:
        if not 0.0 <= freeze_start <= 1.0:
            raise ValueError(f"LayerFreezing(freeze_start={freeze_start!r}): must be a fraction of training in [0, 1]")
        if not 0.0 <= freeze_level <= 1.0:
            raise ValueError(f"LayerFreezing(freeze_level={freeze_level!r}): must be a fraction of layers in [0, 1]")
        self.freeze_start = freeze_start
        self.freeze_level = freeze_level
        self.num_frozen = 0
        self.frozen_layers: list[str] = []

    def match(self, event: Event, state: State) -> bool:
        return event in (Event.FIT_START, Event.BATCH_END)

    def apply(self, event: Event, state: State, logger: Any) -> None:
        layers = _layers(state.model)
        if event == Event.FIT_START:  # reapply what a checkpoint says was frozen
            first, target = 0, self.num_frozen
        else:
            elapsed = state.get_elapsed_duration()
            if elapsed is None:
                raise ValueError("LayerFreezing needs the run's max_duration to know how far training is")
            first = self.num_frozen
            target = max(first, int(freeze_fraction(elapsed, self.freeze_start, self.freeze_level) * len(layers)))
            if target == first:
                return
        for _, layer in layers[first:target]:
            for param in layer.parameters(recurse=False):
                param.requires_grad_(False)
                param.grad = None
        self.num_frozen = target
        self.frozen_layers = [name for name, _ in layers[:target]]
        if event == Event.BATCH_END and hasattr(logger, "log_metrics"):
            logger.log_metrics({"layer_freezing/num_frozen": target}, step=state.timestamp.batch.value)

    def state_dict(self) -> dict[str, Any]:
        return {"num_frozen": self.num_frozen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_frozen = int(state.get("num_frozen", 0))
