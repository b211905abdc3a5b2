"""The progress bar on rank 0: epoch, batch of batches, loss, lr, throughput, ETA (tqdm)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from kiln.core.time import TimeUnit

if TYPE_CHECKING:
    from kiln.loggers.logger import Logger

__all__ = ["ProgressBar"]


class ProgressBar:
    """A tqdm bar per epoch on an interactive terminal; one summary line per epoch otherwise.

    The bar reads like::

        epoch 2/10:  40%|████      | 40/100 [00:10<00:15, 3.95ba/s, loss=0.231, lr=0.001, sp/s=505, eta=02:31]

    tqdm gives the batches, the epoch's elapsed and remaining time and its batches per second; the
    postfix adds the loss, the learning rate, the throughput since the last redraw (``tok/s`` when
    the batches count tokens, else ``sp/s``: samples of all ranks, as the timestamp counts them)
    and ``eta``, the time left in the whole run at the training speed so far (evaluation and
    checkpoints not counted). It redraws at most every ``refresh_interval`` seconds, and the postfix
    is computed only when it redraws, from Python numbers the loop already keeps.

    The bar reads nothing from the device while an epoch runs, so it adds no host synchronisation
    to a step. The loss and lr it shows are the ``train/loss`` and ``train/lr`` that ``logger`` (a
    :class:`kiln.loggers.Logger`) last wrote: the Trainer's one read per ``log_interval``, shared,
    and the same rank average the loggers write. When no loss was logged, the loss is read once per
    epoch, at its last batch (the bar's last redraw, or the summary line).

    Args:
        enabled: draw anything at all (the Trainer enables it on rank 0 only).
        stream: where to draw (default ``sys.stderr``); the tqdm bar needs ``stream.isatty()``.
        logger: the Logger whose last written values the bar shows (None: none).
        refresh_interval: the least seconds between two redraws (tqdm's ``mininterval``).
    """

    def __init__(
        self,
        enabled: bool = True,
        stream: Any = None,
        logger: Logger | None = None,
        refresh_interval: float = 0.25,
    ) -> None:
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.logger = logger
        self.refresh_interval = refresh_interval
        self._bar: Any = None
        self._epoch_line: str | None = None
        self._window: tuple[int, int, float] | None = None  # (samples, tokens, seconds) at the last redraw

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
        self._window = None
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
                mininterval=self.refresh_interval,
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
            bar.set_postfix(self._postfix(state, read=last), refresh=False)

    def _postfix(self, state: Any, read: bool) -> dict[str, str]:
        postfix = {}
        loss = self._loss(state, read=read)
        if loss is not None:
            postfix["loss"] = f"{loss:.4g}"
        lr = self._logged("train/lr")
        if lr is None:
            lr = state.lr
        if lr is not None:
            postfix["lr"] = f"{lr:.3g}"
        unit, rate = self._throughput(state.timestamp)
        if rate is not None:
            postfix[unit] = f"{rate:.3g}"
        eta = _eta(state)
        if eta is not None:
            from tqdm import tqdm

            postfix["eta"] = tqdm.format_interval(eta)
        return postfix

    def _throughput(self, ts: Any) -> tuple[str, float | None]:
        """Samples (tokens, when counted) per second since the last redraw (this epoch's at the first)."""
        now = (ts.sample.value, ts.token.value, ts.total_wct)
        window, self._window = self._window, now
        if window is None or now[2] <= window[2]:
            seconds = ts.epoch_wct
            samples, tokens = ts.sample_in_epoch.value, ts.token_in_epoch.value
        else:
            seconds = now[2] - window[2]
            samples, tokens = now[0] - window[0], now[1] - window[1]
        if seconds <= 0:
            return "sp/s", None
        return ("tok/s", tokens / seconds) if tokens else ("sp/s", samples / seconds)

    def end_epoch(self, state: Any) -> None:
        if self.enabled and self._epoch_line is not None:
            loss = self._loss(state, read=True)
            if loss is not None:
                ts = state.timestamp
                rate = ts.batch_in_epoch.value / ts.epoch_wct if ts.epoch_wct else 0.0
                unit, throughput = self._throughput(ts)
                print(
                    f"{self._epoch_line}: {ts.batch_in_epoch.value} batches, loss {loss:.4g}, {rate:.1f} ba/s"
                    + (f", {throughput:.4g} {unit}" if throughput is not None else ""),
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


def _eta(state: Any) -> float | None:
    """Seconds left in the run at the training speed so far (None: unknown)."""
    duration, ts = state.max_duration, state.timestamp
    if duration is None:
        return None
    elapsed, unit, total = ts.total_wct, duration.unit, duration.value
    if unit == TimeUnit.SECOND:
        return max(0.0, total - elapsed)
    if unit == TimeUnit.EPOCH:
        batches = state.dataloader_len
        if not batches:
            return None
        done = ts.epoch.value + ts.batch_in_epoch.value / batches
    elif unit == TimeUnit.BATCH:
        done = ts.batch.value
    elif unit == TimeUnit.SAMPLE:
        done = ts.sample.value
    elif unit == TimeUnit.TOKEN:
        done = ts.token.value
    else:
        return None
    if done <= 0 or elapsed <= 0:
        return None
    return elapsed * max(0.0, total - done) / done
