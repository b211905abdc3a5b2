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
