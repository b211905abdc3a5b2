"""Shared fixtures: every test starts with no process group, no kiln context and its own env."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _clean_kiln_state(monkeypatch):
    """Destroy process groups and forget the kiln context around each test; restore env vars."""
    saved = dict(os.environ)
    yield
    import torch.distributed as dist

    from kiln.launch.context import destroy

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    destroy()
    os.environ.clear()
    os.environ.update(saved)
    # fsspec keeps one filesystem per set of arguments; an S3 endpoint read from AWS_ENDPOINT_URL
    # is not among them, so a later test's local S3 server (another port) would get this test's.
    s3fs = sys.modules.get("s3fs")
    if s3fs is not None:
        s3fs.S3FileSystem.clear_instance_cache()
