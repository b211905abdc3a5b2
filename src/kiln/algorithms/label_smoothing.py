"""Label smoothing (Szegedy et al., 2016): train towards softened targets."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kiln.algorithms._batch import Key, get_item, set_item
from kiln.algorithms._mixing import soft_targets
from kiln.core.callback import Algorithm
from kiln.core.event import Event

if TYPE_CHECKING:
    from kiln.core.state import State

__all__ = ["LabelSmoothing"]


class LabelSmoothing(Algorithm):
    """Replace targets ``y`` by ``(1 - smoothing) * onehot(y) + smoothing / num_classes`` for the loss.

    Class-index targets become probabilities; targets that already are probabilities (from MixUp or
    CutMix) are smoothed the same way, and since both are linear the order of the three does not
    matter. The loss sees the smoothed targets; they are put back at ``AFTER_BACKWARD``, so metrics
    and callbacks after the step see the dataset's.

    Events: ``BEFORE_LOSS`` (smooth), ``AFTER_BACKWARD`` (restore).

    Args:
        smoothing: the probability mass spread evenly over all classes, in ``[0, 1)``.
        num_classes: number of classes; ``None`` takes ``outputs.shape[-1]``.
        target_key: where the targets are in the batch (``1`` for an ``(inputs, targets)`` tuple).

    Example::

        algorithms = [kiln.algorithms.LabelSmoothing(smoothing=0.1)]
    """

    def __init__(self, smoothing: float = 0.1, num_classes: int | None = None, *, target_key: Key = 1) -> None:
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"LabelSmoothing(smoothing={smoothing!r}): smoothing must be in [0, 1)")
        self.smoothing = smoothing
        self.num_classes = num_classes
        self.target_key = target_key
        self._original: Any = None
        self._replacement: Any = None

    def match(self, event: Event, state: State) -> bool:
        return event in (Event.BEFORE_LOSS, Event.AFTER_BACKWARD)

    def apply(self, event: Event, state: State, logger: Any) -> None:
        if event == Event.BEFORE_LOSS:
            targets = get_item(state.batch, self.target_key)
            outputs = state.outputs
            num_classes = self.num_classes or (outputs.shape[-1] if isinstance(outputs, torch.Tensor) else None)
            if num_classes is None:
                raise ValueError("LabelSmoothing cannot infer num_classes from non-tensor outputs; pass num_classes=")
            floating = isinstance(outputs, torch.Tensor) and outputs.is_floating_point()
            dtype = outputs.dtype if floating else torch.float32
            smoothed = soft_targets(targets, num_classes, dtype) * (1.0 - self.smoothing) + self.smoothing / num_classes
            self._original, self._replacement = targets, smoothed
            state.batch = set_item(state.batch, self.target_key, smoothed)
        else:
            # Only undo our own change: if something replaced the targets since, leave theirs.
            if self._replacement is not None and get_item(state.batch, self.target_key) is self._replacement:
                state.batch = set_item(state.batch, self.target_key, self._original)
            self._original = self._replacement = None
