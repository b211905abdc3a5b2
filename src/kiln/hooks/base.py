"""Colossal-AI's hook interface: `BaseHook` with life-cycle methods and a priority."""

from __future__ import annotations

from typing import Any

__all__ = ["BaseHook"]


class BaseHook:
    """A Colossal-AI trainer hook. Override the life-cycle methods you need; lower ``priority`` runs first.

    Methods receive the :class:`kiln.Trainer` (Colossal-AI's attributes ``engine``, ``states``,
    ``cur_epoch``, ``cur_step``, ``steps_per_epoch`` are there) and, for the ``*_iter`` ends, the
    iteration's ``output``, ``label`` and ``loss``.

    Example::

        class LogMessageHook(kiln.hooks.BaseHook):
            def __init__(self, priority=10):
                super().__init__(priority)
                self._logger = kiln.get_dist_logger()
            def before_train(self, trainer):
                self._logger.info("training starts")
    """

    def __init__(self, priority: int = 10) -> None:
        self.priority = priority

    def after_hook_is_attached(self, trainer: Any) -> None: ...
    def before_train(self, trainer: Any) -> None: ...
    def after_train(self, trainer: Any) -> None: ...
    def before_train_epoch(self, trainer: Any) -> None: ...
    def after_train_epoch(self, trainer: Any) -> None: ...
    def before_train_iter(self, trainer: Any) -> None: ...
    def after_train_iter(self, trainer: Any, output: Any, label: Any, loss: Any) -> None: ...
    def before_test(self, trainer: Any) -> None: ...
    def after_test(self, trainer: Any) -> None: ...
    def before_test_epoch(self, trainer: Any) -> None: ...
    def after_test_epoch(self, trainer: Any) -> None: ...
    def before_test_iter(self, trainer: Any) -> None: ...
    def after_test_iter(self, trainer: Any, output: Any, label: Any, loss: Any) -> None: ...

    def init_runner_states(self, trainer: Any, key: str, val: Any) -> None:
        """Set ``trainer.states[key] = val`` unless another hook did already."""
        trainer.states.setdefault(key, val)
