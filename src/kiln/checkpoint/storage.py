"""Where checkpoints live: the local disk, or any fsspec URL (``s3://``, ``gs://``, ``az://``, ``memory://``).

A save folder is a local path or a URL; :func:`as_path` turns either into a path object (a
``pathlib.Path``, or a :class:`RemotePath` with the few pathlib operations checkpoints use), and
:func:`storage_of` gives the :class:`Storage` that does what differs between the two:

==========================  =========================================  ==========================================
operation                   :class:`LocalStorage`                      :class:`FsspecStorage`
==========================  =========================================  ==========================================
where a save is written     ``ep3-ba120.tmp-<nonce>``                  ``ep3-ba120`` itself (an object store has
                                                                       no rename)
commit                      one ``rename`` to ``ep3-ba120``            nothing more: the manifest, written last
                                                                       (one atomic PUT), is the commit
``last`` / ``best``         relative symlinks (a copy where links      a small pointer object holding the name
                            are impossible)
delete                      rename to ``*.tmp-del-*``, then remove     the manifest first, then the rest
durable small files         write + fsync                              one PUT
DCP writer and reader       ``FileSystemWriter``/``Reader``            ``FsspecWriter``/``Reader``
==========================  =========================================  ==========================================

Either way a checkpoint is visible to readers only once complete: every reader ignores a folder
without ``manifest.json``, and the manifest is written after every other file. A save interrupted
on an object store leaves a folder without a manifest, removed by the next run's cleanup.

Credentials and endpoints come from the fsspec implementation's standard places (for S3:
``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``~/.aws``) or from
``storage_options=`` (passed to the fsspec filesystem, e.g. ``{"endpoint_url": ..., "key": ...}``).
``memory://`` lives in one process: multi-process runs need a storage every rank can see.
"""

from __future__ import annotations

import json
import os
import posixpath
import shutil
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kiln.checkpoint.errors import CheckpointError
from kiln.core.paths import is_url

__all__ = [
    "MANIFEST",
    "TMP",
    "POINTER_FORMAT",
    "is_url",
    "is_temporary",
    "temporary_name",
    "as_path",
    "RemotePath",
    "Storage",
    "LocalStorage",
    "FsspecStorage",
    "storage_of",
    "fsync_dir",
]

MANIFEST = "manifest.json"
TMP = ".tmp-"
POINTER_FORMAT = "kiln-checkpoint-pointer"
# Files a save writes into its folder: a folder on an object store holding only these and no
# manifest is an interrupted save, which cleanup removes (anything else there is left alone).
_SAVE_FILES = (".metadata", ".metadata.tmp", "checkpoint.pt")


def is_temporary(name: str) -> bool:
    return TMP in name


def temporary_name(name: str, nonce: str | None = None) -> str:
    return f"{name}{TMP}{nonce or uuid.uuid4().hex[:12]}"


def as_path(path: Any, storage_options: Mapping[str, Any] | None = None) -> Any:
    """A ``pathlib.Path`` for a local path, a :class:`RemotePath` for a URL (kept as it is if already one)."""
    if isinstance(path, RemotePath):
        return path
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    if text.startswith("file://"):
        return Path(text[len("file://") :])
    if is_url(text):
        return RemotePath.from_url(text, storage_options)
    return Path(text)  # storage_options are for URLs; a run may mix a local save folder and a URL load_path


# -- a path on an fsspec filesystem ---------------------------------------------------------------
class RemotePath:
    """A file or folder at an fsspec URL, with the pathlib operations checkpoints use.

    ``str()`` is the URL; ``/``, ``name``, ``parent``, ``with_name``, ``exists``, ``is_dir``,
    ``is_file``, ``iterdir``, ``rglob("*")``, ``stat().st_size``, ``open``, ``read_bytes``,
    ``read_text`` and ``write_bytes`` behave as pathlib's do. It pickles (the filesystem with its
    options travels along), so ranks can pass it to each other.
    """

    def __init__(self, fs: Any, path: str) -> None:
        self.fs = fs
        self.path = path.rstrip("/") or "/"

    @classmethod
    def from_url(cls, url: str, storage_options: Mapping[str, Any] | None = None) -> RemotePath:
        try:
            from fsspec.core import url_to_fs  # type: ignore[import-untyped]  # fsspec ships no type hints
        except ImportError:
            raise ImportError(
                f"{url} is a URL: checkpoints on fsspec storage need fsspec (and for s3:// the s3 extra, s3fs)"
            ) from None
        # Other processes (the other ranks, the next run) write the save folder: a cached listing
        # would hide their files, so listings are not cached unless the options say otherwise.
        options = {"use_listings_cache": False, **dict(storage_options or {})}
        try:
            fs, path = url_to_fs(url, **options)
        except ImportError as exc:
            protocol = url.split("://", 1)[0]
            extra = {"s3": "the s3 extra (s3fs)", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
            raise ImportError(
                f"{url}: the {protocol}:// filesystem is not installed ({exc}); install {extra.get(protocol, exc.name)}"
            ) from None
        return cls(fs, path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (RemotePath, (self.fs, self.path))

    def __str__(self) -> str:
        return self.fs.unstrip_protocol(self.path)

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and other.fs is self.fs and other.path == self.path

    def __hash__(self) -> int:
        return hash(self.path)

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(self.fs, posixpath.join(self.path, str(name)))

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.name)[1]

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.fs, posixpath.dirname(self.path))

    def with_name(self, name: str) -> RemotePath:
        return self.parent / name

    def resolve(self) -> RemotePath:
        return self

    def relative_to(self, other: RemotePath) -> Path:
        return Path(posixpath.relpath(self.path, other.path))

    def exists(self) -> bool:
        return bool(self.fs.exists(self.path))

    def is_dir(self) -> bool:
        return bool(self.fs.isdir(self.path))

    def is_file(self) -> bool:
        return bool(self.fs.isfile(self.path))

    def is_symlink(self) -> bool:
        return False

    def stat(self) -> Any:
        return SimpleNamespace(st_size=int(self.fs.size(self.path)))

    def iterdir(self) -> Iterator[RemotePath]:
        for entry in self.fs.ls(self.path, detail=False):
            name = posixpath.basename(str(entry).rstrip("/"))
            if name:
                yield self / name

    def rglob(self, pattern: str) -> Iterator[RemotePath]:
        if pattern != "*":
            raise ValueError("RemotePath.rglob supports only '*'")
        for entry in self.fs.find(self.path):
            yield RemotePath(self.fs, str(entry))

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        if not exist_ok and self.exists():
            raise FileExistsError(str(self))
        self.fs.makedirs(self.path, exist_ok=True)

    def open(self, mode: str = "rb") -> Any:
        return self.fs.open(self.path, mode)

    def read_bytes(self) -> bytes:
        return bytes(self.fs.cat_file(self.path))

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_bytes(self, data: bytes) -> None:
        self.fs.pipe_file(self.path, data)

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.fs.rm_file(self.path)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def rmtree(self) -> None:
        try:
            self.fs.rm(self.path, recursive=True)
        except FileNotFoundError:
            pass


# -- the operations that differ --------------------------------------------------------------------
class Storage:
    """What the checkpoint layout needs of a place to keep checkpoints, beyond pathlib's operations."""

    #: A checkpoint becomes visible by renaming its folder (else: by its manifest, written last).
    renames: bool = True

    def staging(self, folder: Any, name: str, nonce: str) -> Any:
        """The folder a save of ``name`` writes into before its commit."""
        raise NotImplementedError

    def prepare(self, staging: Any) -> None:
        """Create ``staging`` (rank 0, before any rank writes)."""
        raise NotImplementedError

    def write_durably(self, path: Any, data: bytes) -> None:
        raise NotImplementedError

    def commit(self, staging: Any, final: Any) -> Any:
        """Make the finished checkpoint ``staging`` (its manifest written) visible as ``final``."""
        raise NotImplementedError

    def update_link(self, folder: Any, link: str, target: str) -> None:
        raise NotImplementedError

    def link_target(self, folder: Any, link: str) -> str | None:
        raise NotImplementedError

    def remove_checkpoint(self, path: Any) -> None:
        raise NotImplementedError

    def cleanup(self, folder: Any, keep: set[str]) -> list[str]:
        """Remove the debris of interrupted saves, link updates and deletes (except names in ``keep``)."""
        raise NotImplementedError

    def dcp_writer(self, folder: Any, thread_count: int) -> Any:
        raise NotImplementedError

    def read_for_load(self, file: Any) -> Any:
        """What ``torch.load`` reads ``file`` from: the path itself, or its bytes."""
        raise NotImplementedError


def fsync_dir(path: str | os.PathLike) -> None:
    """Persist a folder's entries (new names, renames); a no-op where folders cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except (OSError, TypeError):
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class LocalStorage(Storage):
    """The local disk (or any mounted filesystem every rank sees): renames and symlinks.

    Crash safety comes from three rules: nothing without a manifest is a checkpoint, a folder only
    gets its final name by one ``rename``, and links are replaced by one ``rename`` of a new link
    over the old one. A crash at any moment leaves the old or the new state, plus ``*.tmp-*`` debris.
    """

    renames = True

    def staging(self, folder: Path, name: str, nonce: str) -> Path:
        return Path(folder) / temporary_name(name, nonce)

    def prepare(self, staging: Path) -> None:
        Path(staging).mkdir(parents=True)

    def write_durably(self, path: Path, data: bytes) -> None:
        # Write and fsync: a rename that makes the folder visible must never expose unflushed bytes.
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def commit(self, staging: Path, final: Path) -> Path:
        # An existing checkpoint of the same name (a run that resumed and saved the same step
        # again) is first renamed aside, so the old one stays whole until the new one is in place.
        staging, final = Path(staging), Path(final)
        old = None
        if final.is_dir() and not final.is_symlink():
            old = final.with_name(temporary_name(final.name, "old-" + uuid.uuid4().hex[:8]))
            os.rename(final, old)
        os.rename(staging, final)
        fsync_dir(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def update_link(self, folder: Path, link: str, target: str) -> None:
        folder = Path(folder)
        dst = folder / link
        tmp = folder / temporary_name(link)
        try:
            os.symlink(target, tmp, target_is_directory=True)  # relative: the run folder stays movable
        except (OSError, NotImplementedError):
            shutil.copytree(folder / target, tmp, symlinks=True)  # filesystems without links
        old = None
        new_is_link = tmp.is_symlink()
        if (dst.is_dir() and not dst.is_symlink()) or (dst.is_symlink() and not new_is_link):
            # rename cannot put a link over a folder or a folder over a link: move the old one aside
            # (for a moment there is no `last`; resolve_checkpoint then falls back to the newest)
            old = folder / temporary_name(link, "old-" + uuid.uuid4().hex[:8])
            os.rename(dst, old)
        os.replace(tmp, dst)
        fsync_dir(folder)
        if old is not None and old.is_symlink():
            old.unlink()
        elif old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def link_target(self, folder: Path, link: str) -> str | None:
        dst = Path(folder) / link
        if dst.is_symlink():
            return Path(os.readlink(dst)).name
        if dst.is_dir():
            try:
                return str(json.loads((dst / MANIFEST).read_text()).get("name"))
            except (OSError, ValueError):
                return None
        return None

    def remove_checkpoint(self, path: Path) -> None:
        # Renamed first, so a crash mid-delete leaves temporary debris, not a half checkpoint.
        path = Path(path)
        doomed = path.with_name(temporary_name(path.name, "del-" + uuid.uuid4().hex[:8]))
        os.rename(path, doomed)
        fsync_dir(path.parent)
        shutil.rmtree(doomed, ignore_errors=True)

    def cleanup(self, folder: Path, keep: set[str]) -> list[str]:
        folder = Path(folder)
        if not folder.is_dir():
            return []
        removed = []
        for entry in folder.iterdir():
            if not is_temporary(entry.name) or entry.name in keep:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry.name)
        return removed

    def dcp_writer(self, folder: Path, thread_count: int) -> Any:
        from torch.distributed.checkpoint import FileSystemWriter

        # sync_files: each rank fsyncs what it wrote before DCP reports it done, so the commit
        # that follows never publishes bytes still in a page cache.
        return FileSystemWriter(
            folder, single_file_per_rank=True, sync_files=True, overwrite=True, thread_count=thread_count
        )

    def read_for_load(self, file: Path) -> Any:
        return file


class FsspecStorage(Storage):
    """An fsspec filesystem (object stores above all): no rename, no links, atomic single-object PUTs.

    A save writes straight into its final folder; it becomes a checkpoint when its manifest (one
    PUT, after every other file) appears. ``last``/``best`` are pointer objects, JSON naming the
    checkpoint, replaced by one PUT. A delete removes the manifest first, so a checkpoint never
    looks complete while it is half deleted.
    """

    renames = False

    def staging(self, folder: RemotePath, name: str, nonce: str) -> RemotePath:
        return folder / name

    def prepare(self, staging: RemotePath) -> None:
        if staging.exists():  # a save of the same step again (a resumed run): the old one goes first
            self.remove_checkpoint(staging)
        staging.mkdir(exist_ok=True)

    def write_durably(self, path: RemotePath, data: bytes) -> None:
        path.write_bytes(data)

    def commit(self, staging: RemotePath, final: RemotePath) -> RemotePath:
        assert staging == final, "an fsspec save is written in its final folder"
        return final

    def update_link(self, folder: RemotePath, link: str, target: str) -> None:
        (folder / link).write_bytes(json.dumps({"format": POINTER_FORMAT, "name": target}).encode())

    def link_target(self, folder: RemotePath, link: str) -> str | None:
        pointer = folder / link
        try:
            content = json.loads(pointer.read_bytes())
        except (OSError, ValueError):  # missing (FileNotFoundError), or a folder, or damaged
            return None
        if (
            isinstance(content, dict)
            and content.get("format") == POINTER_FORMAT
            and isinstance(content.get("name"), str)
        ):
            return posixpath.basename(content["name"])
        return None

    def remove_checkpoint(self, path: RemotePath) -> None:
        (path / MANIFEST).unlink(missing_ok=True)  # invisible first: a crash leaves debris, not half a checkpoint
        path.rmtree()

    def cleanup(self, folder: RemotePath, keep: set[str]) -> list[str]:
        if not folder.is_dir():
            return []
        removed = []
        for entry in folder.iterdir():
            if entry.name in keep:
                continue
            if is_temporary(entry.name):
                entry.rmtree()
                removed.append(entry.name)
            elif entry.is_dir() and not (entry / MANIFEST).exists() and _only_save_files(entry):
                entry.rmtree()  # an upload a crash interrupted: it never got its manifest
                removed.append(entry.name)
        return removed

    def dcp_writer(self, folder: RemotePath, thread_count: int) -> Any:
        from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        # No fsync (an fsspec file cannot be fsynced; DCP would call os.sync() for every file):
        # an object is durable once its upload, finished by close(), has succeeded.
        writer = FsspecWriter(
            str(folder), single_file_per_rank=True, sync_files=False, overwrite=True, thread_count=thread_count
        )
        fs = FsspecFileSystem()
        fs.fs = folder.fs  # this path's filesystem, with its storage_options
        writer.fs = fs  # type: ignore[assignment]  # what FsspecWriter itself sets, typed as its base's
        return writer

    def read_for_load(self, file: RemotePath) -> Any:
        import io

        try:
            return io.BytesIO(file.read_bytes())
        except FileNotFoundError:
            raise CheckpointError(file, "is missing", "copy the whole checkpoint folder") from None


def _only_save_files(folder: RemotePath) -> bool:
    names = [posixpath.basename(str(f)) for f in folder.fs.find(folder.path)]
    return all(n in _SAVE_FILES or n.endswith(".distcp") or (n.startswith("rank") and n.endswith(".pt")) for n in names)


LOCAL = LocalStorage()
_FSSPEC = FsspecStorage()


def storage_of(path: Any) -> Storage:
    """The storage ``path`` (a path from :func:`as_path`, or a str) lives on."""
    return _FSSPEC if isinstance(path, RemotePath) or is_url(path) else LOCAL
