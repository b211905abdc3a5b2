"""Gradient clipping by global norm, by value, or adaptively per unit (AGC, Brock et al., 2021)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kiln.core.callback import Algorithm
from kiln.core.event import Event

if TYPE_CHECKING:
    from kiln.core.state import State

__all__ = ["GradientClipping"]

_TYPES = ("norm", "value", "adaptive")


def _unitwise_norm(tensor: torch.Tensor) -> torch.Tensor:
    # One norm per output unit (row of a Linear, filter of a Conv); biases and gains as a whole.
    if tensor.dim() <= 1:
        return torch.linalg.vector_norm(tensor)
    return torch.linalg.vector_norm(tensor, dim=tuple(range(1, tensor.dim())), keepdim=True)


@torch.no_grad()
def clip_adaptive(parameters: list[torch.nn.Parameter], threshold: float, eps: float = 1e-3) -> None:
    """Scale each unit's gradient down to ``threshold * max(||w_unit||, eps)`` where it is larger."""
    for p in parameters:
        if p.grad is None:
            continue
        max_norm = _unitwise_norm(p.detach()).clamp_(min=eps) * threshold
        grad_norm = _unitwise_norm(p.grad)
        clipped = p.grad * (max_norm / grad_norm.clamp(min=1e-6))
        p.grad.copy_(torch.where(grad_norm > max_norm, clipped, p.grad))


class GradientClipping(Algorithm):
    """Clip the final gradients, just before the optimizer steps.

    - ``"norm"``: scale all gradients so their global L2 norm is at most ``clipping_threshold``
      (through the strategy, so sharded gradients are measured as a whole);
    - ``"value"``: clamp each gradient element to ``[-clipping_threshold, clipping_threshold]``;
    - ``"adaptive"``: clip each unit's gradient to ``clipping_threshold`` times that unit's weight
      norm (AGC), which lets networks without normalisation layers train at large batch sizes.

    It runs on ``BEFORE_OPTIMIZER_STEP``, where the Engine has already unscaled fp16 gradients, so
    it clips the true gradients, after every ``AFTER_TRAIN_BATCH`` change (SAM's second pass,
    nnScaler's reductions) whatever the order of the algorithm list. With the Trainer's
    ``clip_grad_norm`` as well, the Engine's clipping comes first.

    Events: ``BEFORE_OPTIMIZER_STEP``.

    Args:
        clipping_type: ``"norm"``, ``"value"`` or ``"adaptive"``.
        clipping_threshold: the maximum norm, value or ratio.

    Example::

        algorithms = [kiln.algorithms.GradientClipping("adaptive", 0.01)]
    """

    def __init__(self, clipping_type: str = "norm", clipping_threshold: float = 1.0) -> None:
        if clipping_type not in _TYPES:
            raise ValueError(f"GradientClipping(clipping_type={clipping_type!r}): expected one of {', '.join(_TYPES)}")
        if not clipping_threshold > 0:
            raise ValueError(f"GradientClipping(clipping_threshold={clipping_threshold!r}): must be > 0")
        self.clipping_type = clipping_type
        self.clipping_threshold = float(clipping_threshold)
        self.last_grad_norm: torch.Tensor | None = None

    def match(self, event: Event, state: State) -> bool:
        return event == Event.BEFORE_OPTIMIZER_STEP

    def apply(self, event: Event, state: State, logger: Any) -> None:
        engine = state.engine
        if self.clipping_type == "norm":
            if engine is not None:
                self.last_grad_norm = engine.strategy.clip_grad_norm_(engine.model, self.clipping_threshold)
            else:
                self.last_grad_norm = torch.nn.utils.clip_grad_norm_(state.model.parameters(), self.clipping_threshold)
        elif self.clipping_type == "value":
            torch.nn.utils.clip_grad_value_(state.model.parameters(), self.clipping_threshold)
        else:
            clip_adaptive(list(state.model.parameters()), self.clipping_threshold)
