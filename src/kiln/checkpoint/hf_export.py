"""A sharded (DCP) checkpoint's model streamed into a Hugging Face folder, one tensor at a time.

:func:`kiln.checkpoint.export.export_hf` calls :func:`dcp_sources` for a sharded checkpoint on the
local disk: the tensors' names, shapes and dtypes come from DCP's ``.metadata``, and each value is
read when the writer (:func:`kiln.models.hf_folder.write_hf_folder`) reaches it, by a DCP load whose
planner asks for that one key (:class:`kiln.checkpoint.serialization.SafeEmptyLoadPlanner` with
``keys={key}``): DCP reads that key's chunks from the ranks' files and assembles the whole tensor.
Nothing gathers the model in one process; the peak is the largest tensor and one chunk's read
buffer (benchmarks/hf_export.py measures it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kiln.checkpoint.errors import CheckpointError
from kiln.checkpoint.serialization import SafeEmptyLoadPlanner, dcp_failure, dcp_reader, read_dcp_metadata
from kiln.models.hf_folder import TensorSource

__all__ = ["dcp_model_entries", "dcp_sources", "read_dcp_key"]

_MODEL = "model."  # the top-level key of the model's state in a kiln checkpoint


def read_dcp_key(path: Any, key: str) -> Any:
    """The value of one flattened key (``"model.model.lm_head.weight"``) of DCP checkpoint ``path``,
    read alone: a whole tensor (assembled from every rank's chunks) or an object."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=dcp_reader(path), planner=SafeEmptyLoadPlanner(keys={key}), no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP wraps failures in a BaseException
        raise dcp_failure(exc, path) from None
    value: Any = state
    for part in _path(state, key):
        value = value[part]
    return value


def _path(state: Mapping[str, Any], key: str) -> list[str]:
    """The nested keys under which the empty planner put flattened ``key`` (``model`` -> name)."""
    head, _, rest = key.partition(".")
    if head in state and isinstance(state[head], Mapping) and rest:
        return [head, *(_path(state[head], rest) if rest not in state[head] else [rest])]
    return [key]


def dcp_model_entries(path: Any) -> dict[str, Any]:
    """The model's entries of DCP checkpoint ``path``: name in the model's state -> DCP metadata
    (``TensorStorageMetadata`` with ``size`` and ``properties.dtype``, or ``BytesStorageMetadata``)."""
    metadata = read_dcp_metadata(path)
    return {key[len(_MODEL) :]: value for key, value in metadata.state_dict_metadata.items() if key.startswith(_MODEL)}


def dcp_sources(path: Any, prefix: str, dtype: torch.dtype | None) -> list[TensorSource]:
    """A :class:`TensorSource` per model tensor whose name starts with ``prefix`` (dropped), each
    read from the checkpoint when written and cast to ``dtype`` when floating (None: as saved)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    sources = []
    for name, entry in sorted(dcp_model_entries(path).items()):  # by name, as a merged checkpoint's export
        if not isinstance(entry, TensorStorageMetadata) or not name.startswith(prefix):
            continue
        saved = entry.properties.dtype
        target = dtype if dtype is not None and saved.is_floating_point else saved
        sources.append(TensorSource(name[len(prefix) :], tuple(entry.size), target, _reader(path, _MODEL + name)))
    return sources


def _reader(path: Any, key: str) -> Any:
    return lambda: read_dcp_key(path, key)
