"""TensorBoardLogger: scalars in TensorBoard event files, written by torch's SummaryWriter."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.loggers import flushing
from kiln.loggers.destination import LoggerDestination, _flatten_params
from kiln.loggers.remote import RemoteFolder, is_url, local_path

if TYPE_CHECKING:
    from kiln.core.state import State

__all__ = ["TensorBoardLogger"]


class TensorBoardLogger(LoggerDestination):
    """Writes each metric as a TensorBoard scalar (``add_scalar``) under ``log_dir``, and images
    with ``add_images`` (one image summary per name and step).

    Hyperparameters are written once as a Markdown table with ``add_text`` under the tag
    ``hyperparameters`` (nested keys dotted). ``add_hparams`` is not used: it writes a separate
    run in a timestamped sub-folder and accepts only scalar values. A call without a step uses
    the number of earlier ``log_metrics`` calls as its step.

    The writer (and ``log_dir``) is created on the first write, so ranks that never write leave
    no event files. ``tensorboard`` is imported when the logger is built, not when ``kiln`` is.

    ``log_dir`` may be an fsspec URL (``s3://bucket/run/tb``, ``memory://...``): the writer then
    writes into a local staging folder, and each flush uploads the event files that grew, each
    whole (object stores cannot append; see :mod:`kiln.loggers.remote`). TensorBoard reads
    ``s3://`` log dirs itself.

    Nothing logged is lost to a crash: events reach the event file (the URL, for a URL) at most
    ``flush_secs`` after they were logged, and all of them when the process ends by an exception,
    by SIGTERM or at exit (see :mod:`kiln.loggers.flushing`).

    Args:
        log_dir: Folder for the event files (a local path or an fsspec URL); view with
            ``tensorboard --logdir <log_dir>``.
        flush_interval: Flush to disk (upload, for a URL) every this many ``log_metrics`` calls
            (and on epoch end, fit end and close).
        flush_secs: Flush (upload, for a URL) at most this many seconds after an event was logged
            (default 2).
        storage_options: For a URL, passed to the fsspec filesystem (for S3 ``endpoint_url``,
            ``key``, ``secret``, ...; by default the standard ``AWS_*`` environment variables).
        rank_zero_only: Write on rank 0 only (the default).

    Raises:
        ImportError: When the ``tensorboard`` package is not installed.

    Example::

        trainer = kiln.Trainer(model, loggers=[TensorBoardLogger("runs/exp1")], ...)
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        flush_interval: int = 100,
        *,
        flush_secs: float = flushing.DEFAULT_FLUSH_SECS,
        storage_options: Mapping[str, Any] | None = None,
        rank_zero_only: bool = True,
    ) -> None:
        super().__init__(rank_zero_only=rank_zero_only)
        if not isinstance(flush_interval, int) or flush_interval < 1:
            raise ValueError(f"TensorBoardLogger flush_interval must be an int >= 1, got {flush_interval!r}")
        self.flush_secs = flushing.check_flush_secs("TensorBoardLogger", flush_secs)
        try:
            # Imported here so that `import kiln` stays fast and works without tensorboard.
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ImportError("TensorBoardLogger needs the tensorboard package: pip install tensorboard") from error
        self._writer_class = SummaryWriter
        self.url = str(log_dir) if is_url(log_dir) else None
        self.log_dir: Path | str = self.url or local_path(log_dir)
        """The local folder, or the URL."""
        self.storage_options = storage_options
        self._remote: RemoteFolder | None = None
        self.flush_interval = flush_interval
        self._writer: Any = None
        self._num_calls = 0
        self._mutex = threading.RLock()  # the flush timer's thread flushes (and uploads) too

    @property
    def writer(self) -> Any:
        """The ``SummaryWriter``, created on first use."""
        if self._writer is None:
            with self._mutex:
                folder = str(self.log_dir)
                if self.url is not None:  # the storage is touched on the first write only
                    if self._remote is None:
                        self._remote = RemoteFolder(self.url, self.storage_options, owner="TensorBoardLogger")
                    folder = str(self._remote.staging)
                # The writer's own thread writes its queue out every flush_secs too (locally).
                self._writer = self._writer_class(log_dir=folder, flush_secs=self.flush_secs)
                flushing.watch(self)
        return self._writer

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        global_step = self._num_calls if step is None else step
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=global_step)
        self._num_calls += 1
        if self._num_calls % self.flush_interval == 0:
            self.flush()
        flushing.mark(self)

    def log_hyperparameters(self, params: dict[str, Any]) -> None:
        rows = [f"| {key} | {value} |" for key, value in _flatten_params(params).items()]
        table = "\n".join(["| name | value |", "| --- | --- |", *rows])
        self.writer.add_text("hyperparameters", table)
        flushing.mark(self)

    def log_text(self, text: str, step: int | None = None) -> None:
        self.writer.add_text("text", text, global_step=step)
        flushing.mark(self)

    def log_images(self, images: Any, name: str, step: int | None = None) -> None:
        self.writer.add_images(name, images, global_step=step, dataformats="NHWC")
        flushing.mark(self)

    def flush(self) -> None:
        with self._mutex:
            if self._writer is not None:
                self._writer.flush()
                if self._remote is not None:
                    self._remote.push()

    def close(self, state: State | None = None, logger: Any = None) -> None:
        with self._mutex:
            flushing.unwatch(self)
            if self._writer is not None:
                self._writer.close()  # flushes first
                self._writer = None
            if self._remote is not None:
                self._remote.close()
