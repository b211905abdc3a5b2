"""FileLogger: metrics as JSON lines, one object per logging call."""

from __future__ import annotations

import json
import os
import posixpath
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from kiln.launch.runlock import FolderInUseError, RunLock, lock_path_for_file
from kiln.loggers import flushing
from kiln.loggers.destination import LoggerDestination
from kiln.loggers.remote import RemoteFolder, is_url, local_path

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

    One run per file: a local file is locked while written (``.<name>.kiln-lock`` beside it; see
    :mod:`kiln.launch.runlock`), so a second live run logging to the same path is refused with one
    line naming it (when the Trainer is built, and at the first write) instead of mixing two
    histories in one file. The lock is given back on ``close`` and at exit.

    Nothing logged is lost to a crash: records are written to the file at most ``flush_secs``
    after they were logged (by a background timer, so a SIGKILL loses at most those seconds), and
    all of them when the process ends by an exception, by SIGTERM or at exit (see
    :mod:`kiln.loggers.flushing`). A flush hands the lines to the operating system (no fsync), so
    they survive the process, not a power cut.

    ``path`` may be an fsspec URL (``s3://bucket/run/metrics.jsonl``, ``memory://...``): object
    stores cannot append, so the file is kept in a local staging copy (the URL's file first, when
    a resumed run finds one) and uploaded whole at each flush; a reader sees it as of the last
    flush (see :mod:`kiln.loggers.remote`).

    Args:
        path: The ``.jsonl`` file to append to: a local path or an fsspec URL.
        flush_interval: Flush to disk (upload, for a URL) every this many records (and on
            ``close``, epoch end and fit end).
        flush_secs: Flush at most this many seconds after a record was logged (default 2).
        storage_options: For a URL, passed to the fsspec filesystem (for S3 ``endpoint_url``,
            ``key``, ``secret``, ...; by default the standard ``AWS_*`` environment variables).
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
        flush_secs: float = flushing.DEFAULT_FLUSH_SECS,
        storage_options: Mapping[str, Any] | None = None,
        rank_zero_only: bool = True,
    ) -> None:
        super().__init__(rank_zero_only=rank_zero_only)
        if not isinstance(flush_interval, int) or flush_interval < 1:
            raise ValueError(f"FileLogger flush_interval must be an int >= 1, got {flush_interval!r}")
        self.flush_secs = flushing.check_flush_secs("FileLogger", flush_secs)
        self.url = str(path) if is_url(path) else None
        self.path: Path | str = self.url or local_path(path)
        """The local file, or the URL."""
        self.storage_options = storage_options
        self._remote: RemoteFolder | None = None
        self._name = ""
        self.flush_interval = flush_interval
        self._file: IO[str] | None = None
        self._num_unflushed = 0
        # Writes come from the loop, flushes also from the flush timer's thread (and a SIGTERM
        # handler, which runs in the main thread between two bytecodes: hence re-entrant).
        self._mutex = threading.RLock()
        self._lock = None if self.url else RunLock(lock_path_for_file(self.path), "FileLogger path", self.path)

    def init(self, state: State, logger: Any) -> None:
        # Refused when the Trainer is built, on the rank that would write (before any training).
        if self._lock is not None and (state.rank == 0 or not self.rank_zero_only):
            refusal = self._lock.conflict()
            if refusal is not None:
                raise FolderInUseError(refusal)

    def _write(self, record: dict[str, Any]) -> None:
        # default=str: a hyperparameter that is a class or a path is still recorded, as text.
        line = json.dumps(record, default=str) + "\n"
        with self._mutex:
            if self._file is None:
                self._file = self._open()
                flushing.watch(self)
            self._file.write(line)  # one call: a flush from another thread never splits a line
            self._num_unflushed += 1
            if self._num_unflushed >= self.flush_interval:
                self.flush()
        flushing.mark(self)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self._write({"step": step, "metrics": metrics})

    def log_hyperparameters(self, params: dict[str, Any]) -> None:
        self._write({"hyperparameters": params})

    def log_text(self, text: str, step: int | None = None) -> None:
        self._write({"step": step, "text": text})

    def _open(self) -> IO[str]:
        if self.url is None:
            path = Path(self.path)
            path.parent.mkdir(parents=True, exist_ok=True)
            if self._lock is not None:
                self._lock.acquire()
            return path.open("a", encoding="utf-8")
        if self._remote is None:  # built on the first write: only writing ranks touch the storage
            folder, self._name = posixpath.split(self.url.rstrip("/"))
            self._remote = RemoteFolder(folder, self.storage_options, owner="FileLogger")
        return self._remote.pull(self._name).open("a", encoding="utf-8")

    def flush(self) -> None:
        with self._mutex:
            if self._file is not None:
                self._file.flush()
                if self._remote is not None:
                    self._remote.push()
            self._num_unflushed = 0

    def close(self, state: State | None = None, logger: Any = None) -> None:
        with self._mutex:
            flushing.unwatch(self)
            if self._file is not None:
                self._file.close()
                self._file = None
            if self._remote is not None:
                self._remote.close()
            if self._lock is not None:
                self._lock.release()
            self._num_unflushed = 0
