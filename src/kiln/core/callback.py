"""Callbacks and algorithms: the two kinds of object that run on events."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kiln.core.event import Event

if TYPE_CHECKING:
    from kiln.core.state import State

__all__ = ["Callback", "Algorithm"]


class Callback:
    """Something that observes the loop: override the method named after an event.

    ``run_event(event, state, logger)`` calls ``self.<event value>(state, logger)``, e.g.
    ``def batch_end(self, state, logger)``. State a callback keeps across a resume goes in
    ``state_dict``/``load_state_dict`` and is saved in every checkpoint.

    Example::

        class PrintLoss(kiln.Callback):
            def batch_end(self, state, logger):
                print(state.timestamp.batch.value, float(state.loss))
    """

    def run_event(self, event: Event, state: State, logger: Any) -> None:
        method = getattr(self, event.value, None)
        if method is not None:
            method(state, logger)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self, state: State, logger: Any) -> None:
        """Called once when the Trainer is closed (release files, writers)."""


class Algorithm:
    """Something that changes the training: ``match`` says when, ``apply`` does it.

    Example::

        class ScaleLoss(kiln.Algorithm):
            def match(self, event, state):
                return event == kiln.Event.AFTER_LOSS
            def apply(self, event, state, logger):
                state.loss = state.loss * 0.5
    """

    # True when the algorithm leaves some parameters without gradients on some steps (frozen or
    # skipped layers): the Trainer then has DDP look for unused parameters, as Composer does.
    find_unused_parameters: bool = False

    def match(self, event: Event, state: State) -> bool:
        raise NotImplementedError(f"{type(self).__name__} must implement match(event, state)")

    def apply(self, event: Event, state: State, logger: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement apply(event, state, logger)")

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    @property
    def interpolates_loss(self) -> bool:
        """True for algorithms that replace the loss by a mix of losses (MixUp, CutMix).

        Only one such algorithm may run in a Trainer at a time.
        """
        return False
