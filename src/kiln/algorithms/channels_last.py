"""Channels-last memory format: NHWC tensors, which convolutions on tensor cores run fastest in."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kiln.algorithms._batch import Key, get_item, set_item
from kiln.core.callback import Algorithm
from kiln.core.event import Event

if TYPE_CHECKING:
    from kiln.core.state import State

__all__ = ["ChannelsLast"]


class ChannelsLast(Algorithm):
    """Store the model's 4-D weights and the 4-D inputs in ``torch.channels_last`` memory format.

    Values and shapes do not change, only the strides; convolutions then pick NHWC kernels, which
    avoid layout transposes on GPU tensor cores under mixed precision. Conversion happens once at
    ``INIT`` (or ``FIT_START`` when there was no ``INIT``); inputs are converted before each forward.

    Events: ``INIT``, ``FIT_START``, ``BEFORE_FORWARD``, ``EVAL_BEFORE_FORWARD``.

    Args:
        input_key: where the images are in the batch (``0`` for an ``(inputs, targets)`` tuple).

    Example::

        algorithms = [kiln.algorithms.ChannelsLast()]
    """

    def __init__(self, *, input_key: Key = 0) -> None:
        self.input_key = input_key
        self._converted: set[int] = set()

    def match(self, event: Event, state: State) -> bool:
        return event in (Event.INIT, Event.FIT_START, Event.BEFORE_FORWARD, Event.EVAL_BEFORE_FORWARD)

    def apply(self, event: Event, state: State, logger: Any) -> None:
        if event in (Event.INIT, Event.FIT_START):
            if id(state.model) not in self._converted:
                # In place: parameters keep their identity, so the optimizer still holds them.
                state.model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # stubs lack memory_format
                self._converted.add(id(state.model))
            return
        inputs = get_item(state.batch, self.input_key)
        if isinstance(inputs, torch.Tensor) and inputs.dim() == 4:
            state.batch = set_item(state.batch, self.input_key, inputs.contiguous(memory_format=torch.channels_last))
