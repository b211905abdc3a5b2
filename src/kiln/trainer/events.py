"""Event dispatch: algorithms first, then callbacks, loggers last, with per-event handler lists
built once so an event nobody listens to costs one dict lookup."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from kiln.core.callback import Algorithm, Callback
from kiln.core.event import Event
from kiln.core.state import State
from kiln.launch import heartbeat

__all__ = ["EventRunner"]

# Events inside a training batch, before the timestamp counts it: described with the batch's number.
_IN_BATCH = frozenset(
    {
        Event.BEFORE_DATALOADER,
        Event.AFTER_DATALOADER,
        Event.BATCH_START,
        Event.BEFORE_TRAIN_BATCH,
        Event.BEFORE_FORWARD,
        Event.AFTER_FORWARD,
        Event.BEFORE_LOSS,
        Event.AFTER_LOSS,
        Event.BEFORE_BACKWARD,
        Event.AFTER_BACKWARD,
        Event.AFTER_TRAIN_BATCH,
        Event.BEFORE_OPTIMIZER_STEP,
    }
)


# Iterating an Enum class runs Python code for each member; a tuple, once, does not.
_EVENTS = tuple(Event)


def _listens(callback: Callback, event: Event) -> bool:
    # A callback that keeps the base run_event only reacts to events whose method it overrides,
    # so the others can be skipped without calling it.
    cls = type(callback)
    if cls.run_event is not Callback.run_event:
        return True
    method = getattr(cls, event.value, None)
    return method is not None and method is not getattr(Callback, event.value, None)


class EventRunner:
    """Runs algorithms, callbacks and loggers on each event, in that order.

    On ``after_*`` and ``*_end`` events algorithms run in reverse order, so an algorithm that
    wraps a step undoes its change in the opposite order of applying it (as in Composer).

    ``add(callback)`` and ``remove(callback)`` work at any time, also from inside an event (one
    callback adding or removing another at ``BATCH_END``): the change holds from the next event on,
    and the event running now finishes with the callbacks it started with.

    Example::

        class MonitorFrom(kiln.Callback):
            def __init__(self, trainer, batch):
                self.trainer, self.batch = trainer, batch

            def batch_end(self, state, logger):
                if state.timestamp.batch.value == self.batch:  # SpeedMonitor runs from BATCH_CHECKPOINT on
                    self.trainer.events.add(kiln.callbacks.SpeedMonitor())
                    self.trainer.events.remove(self)
    """

    def __init__(self, state: State, logger: Any) -> None:
        self.state = state
        self.logger = logger
        self.event: Event | None = None  # the last event run: what a stuck rank's heartbeat reports
        # The events someone listens to. Updated in place, never replaced: the training loop holds
        # this set for a whole fit() and skips the events outside it with one lookup.
        self.active: set[Event] = set()
        self._callbacks: dict[Event, list[Callback]] = {}
        # Counts rebuilds: the Trainer keeps its per-step choices (which events a step fires) until it moves.
        self.version = 0
        # What the last rebuild read: a rebuild that would read the same changes nothing.
        self._built_from: tuple[Any, ...] | None = None
        self.rebuild()

    def add(self, callback: Callback) -> None:
        """Append ``callback`` to ``state.callbacks`` and run it from the next event on."""
        self.state.callbacks.append(callback)
        self.rebuild()

    def remove(self, callback: Callback) -> None:
        """Take ``callback`` out of ``state.callbacks``; it runs on no event after the current one."""
        self.state.callbacks.remove(callback)
        self.rebuild()

    def rebuild(self) -> None:
        """Recompute who listens to what from ``state.callbacks``, ``state.algorithms`` and the
        logger's destinations (``add``/``remove`` call this; ``fit()`` too, for lists edited directly)."""
        listeners = [*self.state.callbacks, *self.logger.destinations]
        built_from = (*listeners, bool(self.state.algorithms), heartbeat.current())
        previous = self._built_from
        if previous is not None and len(previous) == len(built_from) and all(map(operator.is_, previous, built_from)):
            # fit() asks at every call: the same listeners give the same lists, and the version
            # stays, so the Trainer's step choices hold
            return
        self._built_from = built_from
        # Fresh lists, never edited afterwards: a run() iterating the old ones while a callback adds
        # or removes another goes on with the old ones, so the change starts at the next event.
        self._callbacks = {e: [c for c in listeners if _listens(c, e)] for e in _EVENTS}
        if heartbeat.current() is not None:
            # With several ranks every event runs, so the heartbeat knows this rank's last one: a few
            # hundred ns each, against the collectives of every distributed step (see heartbeat.py).
            active = set(_EVENTS)
        else:
            active = {e for e in _EVENTS if self._callbacks[e] or self.state.algorithms}
        self.active.clear()
        self.active.update(active)
        self.version += 1

    def describe(self) -> str:
        """The last event and the batch it belongs to: ``AFTER_FORWARD (batch 5)`` (batches count from 1)."""
        event = self.event
        if event is None:
            return "no kiln event yet"
        batch = self.state.timestamp._batch + (event in _IN_BATCH)
        return f"{event.name} (batch {batch})"

    def run(self, event: Event) -> None:
        self.event = event
        state, logger = self.state, self.logger
        algorithms: Sequence[Algorithm] = state.algorithms
        if algorithms:
            for algorithm in reversed(algorithms) if event.is_after_event else algorithms:
                if algorithm.match(event, state):
                    algorithm.apply(event, state, logger)
        for callback in self._callbacks[event]:
            callback.run_event(event, state, logger)
