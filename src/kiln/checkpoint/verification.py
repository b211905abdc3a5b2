"""Checking a checkpoint's files against its manifest: presence, size, checksum.

A load checks before it changes anything: sizes first, then checksums. The checksums of the large
files (DCP's ``.distcp``) run in background threads while DCP plans the load (reads ``.metadata``,
builds the target state), and DCP's reader waits for them, on every rank, before it reads a tensor
(see :class:`kiln.checkpoint.serialization.SafeFileSystemReader`). On object stores the checksum
pass keeps the bytes it downloaded, so that the load downloads each file once.

Reading the tensors into temporaries while hashing, and copying them in once the checksums match,
was tried and measured slower: holding a whole checkpoint in fresh memory costs a page fault per
4 KiB (0.4 s for 1.2 GB here), ten times the checksum pass it was meant to hide.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kiln.checkpoint.errors import CheckpointError
from kiln.checkpoint.hashing import CHECKSUM, new_digest, record, recorded_checksum
from kiln.checkpoint.storage import MANIFEST, RemotePath, as_path

__all__ = ["checksum_file", "hash_files", "verify_files", "PendingChecksums", "memory_to_spare"]

_CHUNK = 16 << 20  # the hash releases the GIL on large buffers, so big chunks also let training run


def checksum_file(path: Any, algorithm: str = CHECKSUM, keep: bool = False) -> tuple[str, bytes | None]:
    """The hex digest of the file ``path``, and with ``keep`` (object stores only) its bytes, downloaded
    once for both the checksum and the load."""
    path = as_path(path)
    digest = new_digest(algorithm)
    if isinstance(path, RemotePath):
        if keep:  # one GET: the bytes are the load's too
            data = path.fs.cat_file(path.path)
            digest.update(data)
            return str(digest.hexdigest()), data
        # Ranged reads, no file object: one may be shared between threads (memory:// hands every
        # reader the same one), and a load reads the same file meanwhile.
        size, start = path.stat().st_size, 0
        while start < size:
            chunk = path.fs.cat_file(path.path, start=start, end=min(size, start + 4 * _CHUNK))
            if not chunk:
                break
            digest.update(chunk)
            start += len(chunk)
        return str(digest.hexdigest()), None
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        # Mapped, not read: the hash reads the page cache where it is, with no copy into a buffer
        # first (that copy cost as much as the hash itself). One window at a time, unmapped before
        # the next: a whole file's mapping counts every page it touched in the process's resident
        # memory until it is unmapped (1.27 GB for a DCP file of that size, the largest part of
        # `kiln checkpoint export --hf`'s peak), a window only its _CHUNK, at the same speed.
        for start in range(0, size, _CHUNK):  # _CHUNK is a multiple of mmap.ALLOCATIONGRANULARITY
            with mmap.mmap(f.fileno(), min(_CHUNK, size - start), offset=start, access=mmap.ACCESS_READ) as window:
                digest.update(window)  # the hash releases the GIL for the whole window
    return str(digest.hexdigest()), None


def hash_files(root: Any, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The manifest record (checksum and size) of each file; files are hashed in parallel threads."""
    root, names = as_path(root), list(names)
    workers = max(1, min(len(names), os.cpu_count() or 1, 8))
    with ThreadPoolExecutor(workers) as pool:
        digests = list(pool.map(lambda n: checksum_file(root / n)[0], names))
    return {n: record(d, (root / n).stat().st_size) for n, d in zip(names, digests)}


def verify_files(
    path: Any, manifest: Mapping[str, Any], names: Iterable[str] | None = None, checksums: bool = True
) -> None:
    """Check that each listed file exists with its recorded size (and checksum); raise naming the first bad one.

    Sizes are checked first, for every file; the checksums of several files are then computed in
    parallel threads, a large file's in one thread.
    """
    path = as_path(path)
    files = manifest["files"]
    names = sorted(files) if names is None else list(names)
    for name in names:
        entry = files[name]
        file = path / name
        if ".." in Path(name).parts or Path(name).is_absolute():
            raise CheckpointError(path / MANIFEST, f"lists a file outside the checkpoint: {name!r}")
        if not file.is_file():
            raise CheckpointError(
                file, "is missing", "the checkpoint was copied incompletely; copy it again or load another"
            )
        size = file.stat().st_size
        if size != entry.get("bytes"):
            raise CheckpointError(
                file,
                f"is truncated or altered: {size} bytes, the manifest says {entry.get('bytes')}",
                "the copy or download was cut short; copy it again or load another checkpoint",
            )
    if checksums:
        PendingChecksums(path, manifest, names).finish()


class PendingChecksums:
    """The checksums of the files ``names`` of checkpoint ``path``, computed in background threads
    (the hash releases the GIL), so that reading the checkpoint can go on meanwhile.

    ``keep`` (object stores): hold each file's bytes once it is hashed (``kept``), for a load that
    would otherwise download it a second time.
    """

    def __init__(self, path: Any, manifest: Mapping[str, Any], names: Iterable[str], keep: bool = False) -> None:
        self.path, self.names, self.manifest = as_path(path), list(names), manifest
        self.keep = keep
        self.kept: dict[str, bytes] = {}
        # XXH3 runs at memory speed in one thread (a second adds nothing here), which leaves the
        # other cores to the load it overlaps; sha256 (manifests of earlier versions) needs them all.
        known = [recorded_checksum(manifest["files"][name]) for name in self.names]
        slow = any(k is not None and k[0] == "sha256" for k in known)
        workers = min(len(self.names), os.cpu_count() or 1, 8) if slow else 1
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="kiln-checksum")
        self._futures: list[Future[tuple[str, bytes | None]] | CheckpointError] = []
        for name, algorithm in zip(self.names, known):
            if algorithm is None:
                self._futures.append(
                    CheckpointError(
                        self.path / name,
                        f"has no checksum this kiln knows in the manifest (its record: {sorted(manifest['files'][name])})",
                        "upgrade kiln, or load with verify=False to check sizes only",
                    )
                )
            else:
                self._futures.append(self._pool.submit(checksum_file, self.path / name, algorithm[0], keep))
        self._pool.shutdown(wait=False)
        self._error: CheckpointError | None = None
        self._done = False

    def error(self) -> CheckpointError | None:
        """Wait for every checksum; the first file whose checksum does not match (or that could not
        be read), as a CheckpointError, or None."""
        if self._done:
            return self._error
        self._pool.shutdown(wait=True)  # every thread gone when the load returns (a fork right after copies none)
        self._done = True
        for name, future in zip(self.names, self._futures):
            problem = self._check(name, future)
            if problem is not None:
                self._error = problem
                self.kept.clear()
                break
        return self._error

    def finish(self) -> None:
        """Wait for every checksum; raise the first mismatch."""
        error = self.error()
        if error is not None:
            raise error

    def _check(self, name: str, future: Any) -> CheckpointError | None:
        if isinstance(future, CheckpointError):
            return future
        try:
            digest, data = future.result()
        except OSError as exc:
            return CheckpointError(self.path / name, f"could not be read ({exc})", "load another checkpoint")
        algorithm, expected = recorded_checksum(self.manifest["files"][name]) or ("", "")
        if digest != expected:
            return CheckpointError(
                self.path / name,
                f"is corrupt: its {algorithm} checksum does not match the manifest",
                "the file was damaged on disk or in transfer; copy it again or load another checkpoint",
            )
        if data is not None:
            self.kept[name] = data
        return None


def memory_to_spare() -> int:
    """Bytes of host memory a load may hold on to for a while: half of what is free now."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):  # not Linux: stay modest
        return 1 << 30
