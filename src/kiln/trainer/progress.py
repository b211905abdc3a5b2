"""The progress bar on rank 0: epoch, batch of batches, loss, lr, throughput, ETA (tqdm)."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["ProgressBar"]


class ProgressBar:
    """A tqdm bar per epoch on an interactive terminal; one summary line per epoch otherwise.

    The loss shown is read from the device only when the bar redraws (tqdm's ``mininterval``), so
    the bar adds no per-step host synchronisation.
    """

    def __init__(self, enabled: bool = True, stream: Any = None) -> None:
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self._bar: Any = None
        self._epoch_line = None

    def start_epoch(self, state: Any) -> None:
        if not self.enabled:
            return
        self.close()
        total_epochs = state.max_duration.value if state.max_duration is not None and state.max_duration.unit.value == "ep" else None
        desc = f"epoch {state.timestamp.epoch.value + 1}" + (f"/{total_epochs}" if total_epochs else "")
        if self.stream.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(total=state.dataloader_len, desc=desc, file=self.stream, dynamic_ncols=True,
                             initial=state.timestamp.batch_in_epoch.value, unit="ba", leave=True)
        else:
            self._epoch_line = desc

    def update(self, state: Any) -> None:
        bar = self._bar
        if bar is None:
            return
        bar.update(1)
        # tqdm redraws at most every mininterval; read the loss (a host sync) only then.
        if bar.n == bar.total or bar.last_print_n == bar.n:
            postfix = {}
            if state.loss is not None:
                postfix["loss"] = f"{float(state.loss.detach()):.4g}"
            if state.lr is not None:
                postfix["lr"] = f"{state.lr:.3g}"
            bar.set_postfix(postfix, refresh=False)

    def end_epoch(self, state: Any) -> None:
        if self.enabled and self._epoch_line is not None and state.loss is not None:
            ts = state.timestamp
            rate = ts.batch_in_epoch.value / ts.epoch_wct if ts.epoch_wct else 0.0
            print(f"{self._epoch_line}: {ts.batch_in_epoch.value} batches, loss {float(state.loss.detach()):.4g}, "
                  f"{rate:.1f} ba/s", file=self.stream, flush=True)
        self._epoch_line = None

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
