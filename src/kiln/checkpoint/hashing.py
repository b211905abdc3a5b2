"""Checksums taken while the files are written, so that a save never reads its files back.

Every byte a save writes passes through a :class:`HashingStream`, which feeds it to sha256 on its
way to the file. ``hashlib`` releases the GIL on large buffers, and DCP writes a rank's files from
several threads, so hashing runs alongside the writes instead of after them (reading a checkpoint
back to hash it cost as much as writing it). The records (``{name: {"sha256", "bytes"}}``) go
into the manifest exactly as :func:`kiln.checkpoint.layout.hash_files` would compute them.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["HashingStream", "HashingFileSystem", "WriteLog", "record_writes", "Records"]

Records = dict[str, dict[str, Any]]


class WriteLog:
    """What one rank wrote for a checkpoint: each file's record, and each failure.

    DCP writes a rank's files from several threads, and an exception in any thread but the first
    is lost (the thread dies, its files are missing from DCP's results, and DCP would still write
    ``.metadata``). Every failure passes through :class:`HashingFileSystem` and is kept here, so
    that :meth:`check` refuses to commit a checkpoint that is missing a file.
    """

    def __init__(self) -> None:
        self.records: Records = {}
        self.failures: list[tuple[str, BaseException]] = []
        self._lock = threading.Lock()

    def add(self, name: str, record: dict[str, Any]) -> None:
        with self._lock:
            self.records[name] = record

    def fail(self, name: str, exc: BaseException) -> None:
        with self._lock:
            self.failures.append((name, exc))

    def rename(self, old: str, new: str) -> None:
        with self._lock:
            record = self.records.pop(old, None)
            if record is not None:
                self.records[new] = record

    def remove(self, name: str) -> None:
        with self._lock:
            self.records.pop(name, None)

    def check(self) -> None:
        """Raise the first failure (as it was raised), if any file could not be written."""
        if self.failures:
            name, exc = self.failures[0]
            raise exc


class HashingStream:
    """A write-only stream that hashes and counts what it passes on to ``raw`` (the file ``name``)."""

    def __init__(self, raw: Any, name: str = "") -> None:
        self.raw = raw
        self.name = name
        self.digest = hashlib.sha256()
        self.bytes = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if not view.contiguous:
            view = memoryview(view.tobytes())
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        self.digest.update(view)
        self.bytes += view.nbytes
        written = self.raw.write(view)
        return view.nbytes if written is None else written

    def record(self) -> dict[str, Any]:
        return {"sha256": self.digest.hexdigest(), "bytes": self.bytes}

    # what DCP and torch.save ask of a stream
    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        self.raw.close()

    @property
    def closed(self) -> bool:
        return bool(getattr(self.raw, "closed", False))


class HashingFileSystem:
    """DCP's filesystem object (``FileSystemWriter.fs``) with every written file hashed on the way.

    The log maps each file's name (DCP writes a flat folder) to its sha256 and size; a rename
    (DCP writes ``.metadata.tmp``, then renames it) carries the record over. Failures are logged too.
    """

    def __init__(self, inner: Any, log: WriteLog | None = None) -> None:
        self.inner = inner
        self.log = WriteLog() if log is None else log

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if "w" not in mode and "a" not in mode:
            with self.inner.create_stream(path, mode) as stream:
                yield stream
            return
        name = _name(path)
        try:
            with self.inner.create_stream(path, mode) as raw:
                stream = HashingStream(raw, name)
                yield stream
        except BaseException as exc:
            self.log.fail(name, exc)
            raise
        self.log.add(name, stream.record())

    def rename(self, path: Any, new_path: Any) -> None:
        self.inner.rename(path, new_path)
        self.log.rename(_name(path), _name(new_path))

    def rm_file(self, path: Any) -> None:
        self.inner.rm_file(path)
        self.log.remove(_name(path))

    def __getattr__(self, name: str) -> Any:  # concat_path, init_path, mkdir, exists, ls: as they are
        return getattr(self.inner, name)


def _name(path: Any) -> str:
    return os.path.basename(str(path).rstrip("/"))


def record_writes(writer: Any, log: WriteLog) -> WriteLog:
    """Hash everything DCP's ``writer`` writes from now on into ``log`` (filled as each file is closed)."""
    writer.fs = HashingFileSystem(writer.fs, log)
    return log
