"""`ThresholdStopper`: end the run once a metric passes a target value."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kiln.callbacks._monitor import comparison, metric_key, read_metric
from kiln.core.callback import Callback
from kiln.core.state import State

__all__ = ["ThresholdStopper"]


class ThresholdStopper(Callback):
    """Stop training as soon as ``comp(value, threshold)`` holds for the monitored metric.

    Checked after each evaluation (``EVAL_END``) for an eval label, at ``EPOCH_END`` for
    ``"train"``, and also at every ``BATCH_END`` with ``stop_on_batch=True``. The default
    comparison is strict, as in Composer and Lightning: ``<`` for names containing loss, error or
    perplexity, ``>`` otherwise; pass ``comp="ge"`` to stop when an accuracy *reaches* 1.0.

    Args:
        monitor: metric name (``"Accuracy"``, read as ``"<label>/Accuracy"``) or a full key.
        dataloader_label: ``"eval"``, ``"train"`` or another evaluation label.
        threshold: the value to pass.
        comp: ``"lt"``, ``"le"``, ``"gt"``, ``"ge"`` (or ``"min"``/``"max"``, ``"<"``...), a callable
            ``comp(value, threshold) -> bool``, or None to choose from the metric name.
        stop_on_batch: for ``"train"`` metrics, check after every batch rather than every epoch.

    Example::

        stopper = kiln.callbacks.ThresholdStopper("Accuracy", "eval", threshold=0.95)
        trainer = kiln.Trainer(model, ..., max_duration="100ep", callbacks=[stopper])
    """

    def __init__(
        self,
        monitor: str,
        dataloader_label: str,
        threshold: float,
        comp: str | Callable[[Any, Any], Any] | None = None,
        stop_on_batch: bool = False,
    ) -> None:
        self.monitor = monitor
        self.dataloader_label = dataloader_label
        self.threshold = float(threshold)
        self.stop_on_batch = stop_on_batch
        self._comp = comparison(comp, monitor, "ThresholdStopper")

    def eval_end(self, state: State, logger: Any) -> None:
        if self.dataloader_label != "train":
            self._check(state)

    def epoch_end(self, state: State, logger: Any) -> None:
        if self.dataloader_label == "train":
            self._check(state)

    def batch_end(self, state: State, logger: Any) -> None:
        if self.stop_on_batch and self.dataloader_label == "train":
            self._check(state)

    def _check(self, state: State) -> None:
        value = read_metric(state, self.monitor, self.dataloader_label, "ThresholdStopper")
        if self._comp(value, self.threshold):
            timestamp = state.timestamp
            state.stop_training(
                f"ThresholdStopper: {metric_key(self.monitor, self.dataloader_label)} = {value:.6g} passed the "
                f"threshold {self.threshold:.6g}; stopping at epoch {timestamp.epoch.value}, batch {timestamp.batch.value}"
            )
