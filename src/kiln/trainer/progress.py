"""The progress bar on rank 0: epoch, batch of batches, loss, lr, throughput, ETA (tqdm)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.loggers.logger import Logger

__all__ = ["ProgressBar"]


class ProgressBar:
    """A tqdm bar per epoch on an interactive terminal; one summary line per epoch otherwise.

    The bar reads nothing from the device while an epoch runs, so it adds no host synchronisation
    to a step. The loss and lr it shows are the ``train/loss`` and ``train/lr`` that ``logger`` (a
    :class:`kiln.loggers.Logger`) last wrote: the Trainer's one read per ``log_interval``, shared,
    and the same rank average the loggers write. When no loss was logged, the loss is read once per
    epoch, at its last batch (the bar's last redraw, or the summary line).

    Args:
        enabled: draw anything at all (the Trainer enables it on rank 0 only).
        stream: where to draw (default ``sys.stderr``); the tqdm bar needs ``stream.isatty()``.
        logger: the Logger whose last written values the bar shows (None: none).
    """

    def __init__(self, enabled: bool = True, stream: Any = None, logger: Logger | None = None) -> None:
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.logger = logger
        self._bar: Any = None
        self._epoch_line: str | None = None

    def start_epoch(self, state: Any) -> None:
        if not self.enabled:
            return
        self.close()
        total_epochs = (
            state.max_duration.value
            if state.max_duration is not None and state.max_duration.unit.value == "ep"
            else None
        )
        desc = f"epoch {state.timestamp.epoch.value + 1}" + (f"/{total_epochs}" if total_epochs else "")
        if self.stream.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=state.dataloader_len,
                desc=desc,
                file=self.stream,
                dynamic_ncols=True,
                initial=state.timestamp.batch_in_epoch.value,
                unit="ba",
                leave=True,
            )
        else:
            self._epoch_line = desc

    def update(self, state: Any) -> None:
        bar = self._bar
        if bar is None:
            return
        bar.update(1)
        last = bar.n == bar.total
        # tqdm redraws at most every mininterval: refresh what the next redraw shows only then.
        if last or bar.last_print_n == bar.n:
            postfix = {}
            loss = self._loss(state, read=last)
            if loss is not None:
                postfix["loss"] = f"{loss:.4g}"
            lr = self._logged("train/lr")
            if lr is None:
                lr = state.lr
            if lr is not None:
                postfix["lr"] = f"{lr:.3g}"
            bar.set_postfix(postfix, refresh=False)

    def end_epoch(self, state: Any) -> None:
        if self.enabled and self._epoch_line is not None:
            loss = self._loss(state, read=True)
            if loss is not None:
                ts = state.timestamp
                rate = ts.batch_in_epoch.value / ts.epoch_wct if ts.epoch_wct else 0.0
                print(
                    f"{self._epoch_line}: {ts.batch_in_epoch.value} batches, loss {loss:.4g}, {rate:.1f} ba/s",
                    file=self.stream,
                    flush=True,
                )
        self._epoch_line = None

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _logged(self, key: str) -> Any:
        value = self.logger.latest.get(key) if self.logger is not None else None
        return value if isinstance(value, (int, float)) else None

    def _loss(self, state: Any, read: bool) -> float | None:
        """The last logged loss; else, when ``read``, this rank's loss read from the device."""
        loss = self._logged("train/loss")
        if loss is None and read and state.loss is not None:
            loss = float(state.loss.detach())  # once per epoch: nothing logged a loss
        return loss
