"""Reading checkpoint files without running code from them.

``torch.load(weights_only=True)`` refuses pickles that name arbitrary callables. DCP does not use
it everywhere: it reads ``.metadata`` with a bare ``pickle.load`` and non-tensor values with
``weights_only=False``, either of which runs whatever a crafted file asks for. This module closes
both doors: a metadata unpickler that accepts only DCP's own plain record classes, and a load
planner whose byte values go through ``weights_only=True``.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from kiln.checkpoint.errors import CheckpointError

__all__ = ["safe_torch_load", "check_loadable", "read_dcp_metadata", "SafeFileSystemReader", "SafeLoadPlanner",
           "SafeEmptyLoadPlanner"]

_UNSAFE_FIX = ("kiln loads checkpoints with weights_only=True and will not run code from a file; "
               "only load checkpoints from sources you trust, and save state as plain data")

# DCP metadata records: dataclasses and enums of plain values, nothing callable.
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                              "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix", "SerializationFormat"},
    "torch.serialization": {"_get_layout"},  # looks a layout up by name in a fixed table
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


def read_dcp_metadata(path: str | os.PathLike) -> Metadata:
    """DCP's ``.metadata`` from checkpoint folder ``path``, refusing anything but its record classes."""
    file = Path(path) / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(file, "is missing (a sharded checkpoint needs it)", "copy the whole checkpoint folder") from None
    except pickle.UnpicklingError as exc:
        raise CheckpointError(file, f"asks to run code while loading ({exc})", _UNSAFE_FIX) from None
    except Exception as exc:  # truncated or garbled pickles fail in many ways
        raise CheckpointError(file, f"is damaged and cannot be read ({type(exc).__name__}: {exc})",
                              "run `kiln checkpoint verify` on the folder; load an earlier checkpoint") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(file, f"holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the safe metadata unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _load_bytes(value: io.BytesIO) -> Any:
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError("<sharded checkpoint value>", f"asks to run code while loading ({_first_line(exc)})",
                              _UNSAFE_FIX) from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        # DefaultLoadPlanner.load_bytes with the one change that matters: weights_only=True.
        obj = _load_bytes(value)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class SafeEmptyLoadPlanner(_EmptyStateDictLoadPlanner):
    """Load a whole DCP checkpoint into a fresh dict (no model needed), values with ``weights_only=True``."""

    load_bytes = SafeLoadPlanner.load_bytes


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return next((line for line in text if "GLOBAL" in line or "Unsupported" in line), text[0] if text else "")


def safe_torch_load(path: str | os.PathLike, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``; every failure is one CheckpointError naming the file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(path, "is missing", "copy the whole checkpoint folder") from None
    except pickle.UnpicklingError as exc:
        if "weights_only" in str(exc) or "GLOBAL" in str(exc):
            raise CheckpointError(path, f"asks to run code while loading ({_first_line(exc)})", _UNSAFE_FIX) from None
        raise CheckpointError(path, f"is damaged ({_first_line(exc)})", "load an earlier checkpoint") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as exc:
        raise CheckpointError(path, f"is truncated or damaged ({type(exc).__name__}: {_first_line(exc)})",
                              "run `kiln checkpoint verify` on the folder; load an earlier checkpoint") from None


def check_loadable(obj: Any, what: str) -> bytes:
    """``torch.save`` bytes of ``obj``, after checking they load back with ``weights_only=True``.

    Run at save time, so that a callback returning a custom object from ``state_dict()`` fails when
    saving, naming the callback, rather than months later when someone tries to resume.
    """
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(what, f"holds an object a checkpoint cannot carry ({_first_line(exc)})",
                              "return plain data (numbers, strings, lists, dicts, tensors) from state_dict(), "
                              "since checkpoints load with weights_only=True") from None
    return data
