"""Logger files at fsspec URLs (``s3://``, ``gs://``, ``memory://``, ...): written locally, uploaded whole.

Object stores have no append and no partial write, so a logger whose destination is a URL writes
its files into a local staging folder as it would locally, and :meth:`RemoteFolder.push` uploads
the files that changed since the last push, each as one whole object (one PUT), when the logger
flushes (every ``flush_interval`` records, at epoch end, fit end and close). A reader of the URL
sees each file as of the last flush, never half of a write. Credentials and endpoints come from
the fsspec implementation's standard places (for S3: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``~/.aws``) or from ``storage_options=`` (for S3: ``endpoint_url``,
``key``, ``secret``, ``client_kwargs``, ...), passed to the fsspec filesystem.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiln.core.paths import is_url

__all__ = ["is_url", "local_path", "RemoteFolder"]


def local_path(path: str | os.PathLike[str]) -> Path:
    """A local path, from a path or a ``file://`` URL."""
    text = os.fspath(path)
    return Path(text[len("file://") :] if text.startswith("file://") else text)


class RemoteFolder:
    """A folder at ``url`` mirrored from a local staging folder (created on first use).

    Args:
        url: the folder's URL.
        storage_options: passed to the fsspec filesystem (``fsspec.core.url_to_fs(url, **options)``).
        owner: the logger's name, for error messages.
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None, owner: str = "logger") -> None:
        try:
            from fsspec.core import url_to_fs  # type: ignore[import-untyped]  # fsspec ships no type hints
        except ImportError:
            raise ImportError(f"{owner}: {url} is a URL, which needs fsspec: pip install fsspec") from None
        # A resumed run reads back what the last one wrote: no cached listings.
        options = {"use_listings_cache": False, **dict(storage_options or {})}
        try:
            self.fs, self.path = url_to_fs(url, **options)
        except ImportError as exc:
            protocol = url.split("://", 1)[0]
            extra = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
            raise ImportError(
                f"{owner}: {url}: the {protocol}:// filesystem is not installed ({exc}); "
                f"pip install {extra.get(protocol, exc.name)}"
            ) from None
        self.url = url
        self.path = self.path.rstrip("/")
        self._staging: Path | None = None
        self._pushed: dict[str, tuple[int, int]] = {}  # relative name -> (size, mtime_ns) last uploaded

    @property
    def staging(self) -> Path:
        """The local folder the logger writes into."""
        if self._staging is None:
            self._staging = Path(tempfile.mkdtemp(prefix="kiln-logger-"))
        return self._staging

    def remote(self, name: str) -> str:
        return posixpath.join(self.path, name)

    def pull(self, name: str) -> Path:
        """The staging copy of ``name``, downloaded first when the URL has it (a resumed run appends)."""
        local = self.staging / name
        local.parent.mkdir(parents=True, exist_ok=True)
        if not local.exists() and self.fs.exists(self.remote(name)):
            self.fs.get_file(self.remote(name), str(local))
            stat = local.stat()
            self._pushed[name] = (stat.st_size, stat.st_mtime_ns)
        return local

    def push(self) -> None:
        """Upload every staged file that changed since its last upload, each whole."""
        if self._staging is None:
            return
        for local in sorted(self._staging.rglob("*")):
            if not local.is_file():
                continue
            name = local.relative_to(self._staging).as_posix()
            stat = local.stat()
            version = (stat.st_size, stat.st_mtime_ns)
            if self._pushed.get(name) == version:
                continue
            remote = self.remote(name)
            self.fs.makedirs(posixpath.dirname(remote), exist_ok=True)
            self.fs.put_file(str(local), remote)
            self._pushed[name] = version

    def close(self) -> None:
        """Upload what changed, then remove the staging folder."""
        self.push()
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None
            self._pushed.clear()
