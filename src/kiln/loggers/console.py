"""ConsoleLogger: one readable line of metrics per logging call."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from kiln.loggers import flushing
from kiln.loggers.destination import LoggerDestination

__all__ = ["ConsoleLogger"]


class ConsoleLogger(LoggerDestination):
    """Prints each ``log_metrics`` call as one line of text.

    For example ``14:02:31 [batch 12] train/loss: 0.1234  train/lr: 0.01``: the time of day first,
    as the Trainer's progress lines have it, so a log file says when each line was written.

    Floats are printed with 6 significant digits. A call whose step is not a multiple of
    ``log_interval`` is skipped, except when it holds an ``eval/`` metric: evaluation results are
    rare and are what a reader waits for, so they always print.

    Args:
        log_interval: Print every ``log_interval``-th step (calls without a step always print).
        stream: Where to print; ``None`` means ``sys.stdout`` at the time of each print (so
            redirection and pytest's capture work).
        rank_zero_only: Print on rank 0 only (the default).
        time_format: ``time.strftime`` format of the time that starts each line; ``None``: no time.

    Example::

        trainer = kiln.Trainer(model, loggers=[ConsoleLogger(log_interval=10)], ...)
    """

    def __init__(
        self,
        log_interval: int = 1,
        stream: TextIO | None = None,
        *,
        rank_zero_only: bool = True,
        time_format: str | None = "%H:%M:%S",
    ) -> None:
        super().__init__(rank_zero_only=rank_zero_only)
        if not isinstance(log_interval, int) or log_interval < 1:
            raise ValueError(f"ConsoleLogger log_interval must be an int >= 1, got {log_interval!r}")
        if time_format is not None and not isinstance(time_format, str):
            raise ValueError(f"ConsoleLogger time_format must be a strftime string or None, got {time_format!r}")
        self.log_interval = log_interval
        self.stream = stream
        self.time_format = time_format
        self.flush_secs = flushing.DEFAULT_FLUSH_SECS

    def _write(self, line: str) -> None:
        if self.time_format is not None:
            line = f"{time.strftime(self.time_format, time.localtime())} {line}"
        print(line, file=self.stream if self.stream is not None else sys.stdout)
        # stdout redirected to a file (nohup, SLURM, a launcher's log) is block-buffered: the
        # flush timer writes the line out within flush_secs, so a killed process still shows it.
        flushing.mark(self)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if step is not None and step % self.log_interval != 0 and not any(key.startswith("eval/") for key in metrics):
            return
        body = "  ".join(f"{key}: {_format(value)}" for key, value in metrics.items())
        self._write(body if step is None else f"[batch {step}] {body}")

    def log_hyperparameters(self, params: dict[str, Any]) -> None:
        body = "  ".join(f"{key}: {_format(value)}" for key, value in params.items())
        self._write(f"[hyperparameters] {body}")

    def log_text(self, text: str, step: int | None = None) -> None:
        self._write(text if step is None else f"[batch {step}] {text}")

    def flush(self) -> None:
        stream = self.stream if self.stream is not None else sys.stdout
        stream.flush()


def _format(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)
