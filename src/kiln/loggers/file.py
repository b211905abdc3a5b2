"""FileLogger: metrics as JSON lines, one object per logging call."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from kiln.loggers.destination import LoggerDestination

if TYPE_CHECKING:
    from kiln.core.state import State

__all__ = ["FileLogger"]


class FileLogger(LoggerDestination):
    """Appends one JSON object per line to ``path``.

    Each ``log_metrics`` call writes ``{"step": 12, "metrics": {"train/loss": 0.1234}}`` (``step``
    is ``null`` when none was given), ``log_hyperparameters`` writes ``{"hyperparameters": {...}}``
    and ``log_text`` writes ``{"step": 12, "text": "..."}``. The file is opened in append mode on
    the first write (parent folders are created then), so a resumed run continues the same file
    and ranks that never write leave no file behind. Non-finite values are written as ``NaN`` /
    ``Infinity``, which Python's ``json`` reads back.

    Args:
        path: The ``.jsonl`` file to append to.
        flush_interval: Flush to disk every this many records (and on ``close``, epoch end and
            fit end).
        rank_zero_only: Write on rank 0 only (the default).

    Example::

        trainer = kiln.Trainer(model, loggers=[FileLogger("runs/exp1/metrics.jsonl")], ...)
        # later: [json.loads(line) for line in open("runs/exp1/metrics.jsonl")]
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        flush_interval: int = 100,
        *,
        rank_zero_only: bool = True,
    ) -> None:
        super().__init__(rank_zero_only=rank_zero_only)
        if not isinstance(flush_interval, int) or flush_interval < 1:
            raise ValueError(f"FileLogger flush_interval must be an int >= 1, got {flush_interval!r}")
        self.path = Path(path)
        self.flush_interval = flush_interval
        self._file: IO[str] | None = None
        self._num_unflushed = 0

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        # default=str: a hyperparameter that is a class or a path is still recorded, as text.
        self._file.write(json.dumps(record, default=str) + "\n")
        self._num_unflushed += 1
        if self._num_unflushed >= self.flush_interval:
            self.flush()

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self._write({"step": step, "metrics": metrics})

    def log_hyperparameters(self, params: dict[str, Any]) -> None:
        self._write({"hyperparameters": params})

    def log_text(self, text: str, step: int | None = None) -> None:
        self._write({"step": step, "text": text})

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
        self._num_unflushed = 0

    def close(self, state: State | None = None, logger: Any = None) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._num_unflushed = 0
