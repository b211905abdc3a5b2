"""Where a path is: one rule for checkpoints and file-writing loggers, which both take fsspec URLs."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["is_url"]


def is_url(path: Any) -> bool:
    """True for ``proto://...`` other than ``file://`` (a local path in URL form).

    Example::

        is_url("s3://bucket/run"), is_url("file:///tmp/run"), is_url("runs/a")   # True, False, False
    """
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    return "://" in text and not text.startswith("file://")
