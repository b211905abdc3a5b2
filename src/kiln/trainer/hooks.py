"""Adapters: Colossal-AI hooks as a kiln Callback on the same events.

=====================  =========================================
kiln event             Colossal-AI hook method
=====================  =========================================
FIT_START              before_train
EPOCH_START            before_train_epoch
BATCH_START            before_train_iter
BATCH_END              after_train_iter(trainer, output, label, loss)
EPOCH_END              after_train_epoch
EVAL_START             before_test, before_test_epoch
EVAL_BATCH_START       before_test_iter
EVAL_BATCH_END         after_test_iter(trainer, output, label, loss)
EVAL_END               after_test_epoch, after_test
FIT_END                after_train
=====================  =========================================
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kiln.core.callback import Callback
from kiln.core.event import Event

__all__ = ["ColossalHookCallback"]

_PLAIN = {
    Event.FIT_START: ("before_train",),
    Event.EPOCH_START: ("before_train_epoch",),
    Event.BATCH_START: ("before_train_iter",),
    Event.EPOCH_END: ("after_train_epoch",),
    Event.EVAL_START: ("before_test", "before_test_epoch"),
    Event.EVAL_BATCH_START: ("before_test_iter",),
    Event.EVAL_END: ("after_test_epoch", "after_test"),
    Event.FIT_END: ("after_train",),
}


class ColossalHookCallback(Callback):
    """Calls Colossal-AI hooks (sorted by ``priority``, lower first) on kiln's events."""

    def __init__(self, hooks: Sequence[Any], trainer: Any) -> None:
        self.hooks = sorted(hooks, key=lambda hook: getattr(hook, "priority", 10))
        self.trainer = trainer
        if not hasattr(trainer, "states"):
            trainer.states = {"metrics": {"train": {}, "test": {}}}
        for hook in self.hooks:
            hook.after_hook_is_attached(trainer)

    def run_event(self, event: Event, state: Any, logger: Any) -> None:
        trainer = self.trainer
        if event == Event.BATCH_END:
            label = state.batch[1] if isinstance(state.batch, (list, tuple)) and len(state.batch) > 1 else None
            for hook in self.hooks:
                hook.after_train_iter(trainer, state.outputs, label, state.loss)
        elif event == Event.EVAL_BATCH_END:
            label = state.batch[1] if isinstance(state.batch, (list, tuple)) and len(state.batch) > 1 else None
            for hook in self.hooks:
                hook.after_test_iter(trainer, state.outputs, label, state.eval_loss)
        else:
            for name in _PLAIN.get(event, ()):
                for hook in self.hooks:
                    getattr(hook, name)(trainer)
