"""Tampering with checkpoint folders the way an attacker or a bad disk would, for the checkpoint tests."""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import torch

from kiln.checkpoint import layout, verification
from kiln.checkpoint.serialization import read_dcp_metadata


class Evil:
    """Unpickling this runs a shell command that creates ``sentinel``: what a malicious checkpoint does."""

    def __init__(self, sentinel):
        self.sentinel = str(sentinel)

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


def evil_pickles(sentinel) -> dict[str, bytes]:
    """The two forms a byte entry can take: a bare pickle, and ``torch.save``'s zip with the pickle inside."""
    buffer = io.BytesIO()
    torch.save({"lr": Evil(sentinel)}, buffer)
    return {"pickle": pickle.dumps(Evil(sentinel)), "torch.save": buffer.getvalue()}


def rehash(path: str | os.PathLike) -> None:
    """Rewrite the manifest's size and checksum of every file (and its own checksum) to match the folder:
    what an attacker does, so that only the loader's refusal to run code protects the user."""
    path = Path(path)
    manifest = json.loads((path / layout.MANIFEST).read_text())
    manifest["files"] = verification.hash_files(path, layout.list_files(path))
    layout.write_manifest(path, manifest)


def replace_dcp_bytes_entry(path: str | os.PathLike, key: str, payload: bytes) -> str:
    """Make the DCP byte entry ``key`` (a non-tensor value such as an optimizer's ``lr``) read ``payload``.

    The payload is appended to the ``.distcp`` file that holds the entry and ``.metadata`` is pointed
    at it (offset and length), so DCP hands exactly these bytes to the load planner. Returns the
    ``.distcp`` file's name. Call :func:`rehash` afterwards.
    """
    path = Path(path)
    metadata = read_dcp_metadata(path)
    index = next(i for i in metadata.storage_data if i.fqn == key)
    info = metadata.storage_data[index]
    file = path / info.relative_path
    offset = file.stat().st_size
    with open(file, "ab") as f:
        f.write(payload)
    info.offset, info.length = offset, len(payload)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    return info.relative_path


def dcp_bytes_keys(path: str | os.PathLike) -> list[str]:
    """The keys of a DCP checkpoint that are stored as pickled bytes (not tensors)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = read_dcp_metadata(path)
    return sorted(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
