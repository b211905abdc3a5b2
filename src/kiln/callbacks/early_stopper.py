"""`EarlyStopper`: end the run when a metric has stopped improving."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kiln.callbacks._monitor import comparison, improved, metric_key, read_metric
from kiln.core.callback import Callback
from kiln.core.state import State
from kiln.core.time import Time, TimeUnit

__all__ = ["EarlyStopper"]

_MODES = ("min", "max")


class EarlyStopper(Callback):
    """Stop training when ``monitor`` has not improved for longer than ``patience``.

    The value is read from ``state.metrics`` after each evaluation (``EVAL_END``) for an eval
    label, or at ``EPOCH_END`` (and, with a batch patience, ``BATCH_END``) for ``"train"``. A value
    improves when it beats the best so far by more than ``min_delta``. As in Composer, the run
    stops at the first check where *more than* ``patience`` has passed since the best value: with
    ``patience=1`` and an evaluation every epoch, a best at epoch 2 followed by no improvement
    stops the run at the end of epoch 4. The stop goes through ``state.stop_training(reason)``,
    so the last checkpoint is still written. The best value and when it happened are saved in
    checkpoints.

    Args:
        monitor: metric name, ``"Accuracy"`` or ``"loss"`` (read as ``"<label>/<monitor>"``) or a
            full key such as ``"eval/Accuracy"``.
        dataloader_label: ``"eval"`` (default), ``"train"``, or another evaluation label.
        patience: how long the metric may fail to improve: an int (epochs), a time string
            (``"2ep"``, ``"500ba"``) or a :class:`kiln.Time` in epochs or batches.
        min_delta: the amount a value must beat the best by to count as an improvement.
        mode: ``"min"``, ``"max"`` or None, which picks ``"min"`` for names containing loss,
            error or perplexity and ``"max"`` otherwise.
        comp: Composer's form of ``mode``: ``"lt"``/``"gt"`` or a callable ``comp(value, best)``.

    Example::

        trainer = kiln.Trainer(model, train_dataloader=train, eval_dataloader=val, max_duration="50ep",
                               callbacks=[kiln.callbacks.EarlyStopper("Accuracy", patience=3)])
    """

    def __init__(
        self,
        monitor: str,
        dataloader_label: str = "eval",
        patience: int | str | Time = 1,
        min_delta: float = 0.0,
        mode: str | None = None,
        *,
        comp: str | Callable[[Any, Any], Any] | None = None,
    ) -> None:
        if mode is not None and mode not in _MODES:
            raise ValueError(
                f"EarlyStopper mode must be 'min', 'max' or None (chosen from the metric name), got {mode!r}"
            )
        if mode is not None and comp is not None:
            raise ValueError("EarlyStopper takes `mode` or `comp`, not both")
        self.monitor = monitor
        self.dataloader_label = dataloader_label
        self.patience = Time.from_input(patience, TimeUnit.EPOCH)
        if self.patience.unit not in (TimeUnit.EPOCH, TimeUnit.BATCH):
            raise ValueError(
                f"EarlyStopper patience must be in epochs or batches (e.g. 2, '2ep', '500ba'), got {self.patience}"
            )
        self.min_delta = abs(float(min_delta))
        self._better = comparison(mode or comp, monitor, "EarlyStopper")
        self.best: float | None = None
        self.best_epoch = 0
        self.best_batch = 0

    # -- events ---------------------------------------------------------------------------------
    def eval_end(self, state: State, logger: Any) -> None:
        if self.dataloader_label != "train":
            self._check(state)

    def epoch_end(self, state: State, logger: Any) -> None:
        if self.dataloader_label == "train":
            self._check(state)

    def batch_end(self, state: State, logger: Any) -> None:
        if self.dataloader_label == "train" and self.patience.unit == TimeUnit.BATCH:
            self._check(state)

    def _check(self, state: State) -> None:
        value = read_metric(state, self.monitor, self.dataloader_label, "EarlyStopper")
        timestamp = state.timestamp
        if improved(value, self.best, self._better, self.min_delta):
            # Plain ints, not the Timestamp: the loop mutates its Timestamp in place.
            self.best, self.best_epoch, self.best_batch = value, timestamp.epoch.value, timestamp.batch.value
            return
        if self.patience.unit == TimeUnit.EPOCH:
            waited, since = timestamp.epoch.value - self.best_epoch, f"epoch {self.best_epoch}"
        else:
            waited, since = timestamp.batch.value - self.best_batch, f"batch {self.best_batch}"
        if waited > self.patience.value:
            state.stop_training(
                f"EarlyStopper: {metric_key(self.monitor, self.dataloader_label)} has not improved on its best "
                f"{self.best:.6g} (at {since}) for {waited}{self.patience.unit.value}, more than the patience of "
                f"{self.patience}; stopping at epoch {timestamp.epoch.value}, batch {timestamp.batch.value}"
            )

    # -- checkpointed state -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch, "best_batch": self.best_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        best = state.get("best")
        self.best = None if best is None else float(best)
        self.best_epoch = int(state.get("best_epoch", 0))
        self.best_batch = int(state.get("best_batch", 0))
