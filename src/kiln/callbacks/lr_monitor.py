"""`LRMonitor`: log every optimizer parameter group's learning rate."""

from __future__ import annotations

from typing import Any

from kiln.core.callback import Callback
from kiln.core.state import State

__all__ = ["LRMonitor"]


class LRMonitor(Callback):
    """Log the learning rate of every parameter group after every batch.

    Keys are ``lr-<OptimizerClass>/group<i>`` (Composer's names; a second optimizer of the same
    class gets ``lr-<OptimizerClass>-1/...``), plus ``train/lr`` for the first group of the first
    optimizer. Logged at ``BATCH_END``, after the scheduler stepped, so the value is the rate the
    next batch will use. Tensor learning rates (``capturable`` optimizers) are handed to the
    logger as they are; it converts them with one host copy.

    Example::

        trainer = kiln.Trainer(model, ..., callbacks=[kiln.callbacks.LRMonitor()])
        # logs {"lr-AdamW/group0": 0.001, "train/lr": 0.001} every batch
    """

    def __init__(self) -> None:
        self._names: list[str] | None = None

    def _optimizer_names(self, optimizers: list[Any]) -> list[str]:
        names: list[str] = []
        for optimizer in optimizers:
            base = f"lr-{type(optimizer).__name__}"
            seen = sum(1 for name in names if name == base or name.startswith(f"{base}-"))
            names.append(base if seen == 0 else f"{base}-{seen}")
        return names

    def batch_end(self, state: State, logger: Any) -> None:
        optimizers = state.optimizers
        if not optimizers:
            return
        if self._names is None or len(self._names) != len(optimizers):
            self._names = self._optimizer_names(optimizers)  # computed once: the optimizers do not change
        metrics: dict[str, Any] = {}
        for name, optimizer in zip(self._names, optimizers):
            for i, group in enumerate(optimizer.param_groups):
                metrics[f"{name}/group{i}"] = group["lr"]
        metrics["train/lr"] = optimizers[0].param_groups[0]["lr"]
        logger.log_metrics(metrics)
