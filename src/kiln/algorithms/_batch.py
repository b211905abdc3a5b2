"""Reading and replacing parts of a batch: ``(inputs, targets)`` tuples/lists or dicts of tensors.

Replacing returns a new container rather than mutating the dataloader's, so an algorithm can put
the original back by identity and a batch that a dataloader reuses is never changed under it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kiln.core.batch import num_samples  # re-exported: the rule lives in kiln.core.batch

__all__ = ["get_item", "set_item", "index_batch", "map_tensors", "num_samples"]

Key = int | str


def get_item(batch: Any, key: Key) -> Any:
    """``batch[key]`` for a tuple, list or dict, with an error that names the batch's shape."""
    try:
        return batch[key]
    except (KeyError, IndexError, TypeError):
        kind = f"dict with keys {sorted(batch)}" if isinstance(batch, Mapping) else type(batch).__name__
        raise ValueError(
            f"cannot read key {key!r} of the batch ({kind}); set input_key/target_key to where "
            "the inputs and targets are (0 and 1 for an (inputs, targets) tuple)"
        ) from None


def set_item(batch: Any, key: Key, value: Any) -> Any:
    """A copy of ``batch`` with ``batch[key]`` replaced by ``value``."""
    if isinstance(batch, Mapping):
        new = dict(batch)
        new[key] = value
        if type(batch) is dict:
            return new
        return type(batch)(new)  # type: ignore[call-arg]  # its own mapping class, which takes a dict
    if isinstance(batch, (tuple, list)):
        items = list(batch)
        get_item(batch, key)  # same error as reading a missing key
        items[key] = value  # type: ignore[index]  # get_item refused a key that a list cannot take
        return type(batch)(items) if not hasattr(batch, "_fields") else type(batch)(*items)
    raise ValueError(
        f"cannot replace key {key!r} in a batch of type {type(batch).__name__}; "
        "expected an (inputs, targets) tuple/list or a dict of tensors"
    )


def map_tensors(batch: Any, fn: Any) -> Any:
    """Apply ``fn`` to every tensor of a nested tuple/list/dict batch."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return type(batch)(  # type: ignore[call-arg]  # its own mapping class, which takes a dict
            {k: map_tensors(v, fn) for k, v in batch.items()}
        )
    if isinstance(batch, (tuple, list)):
        items = [map_tensors(v, fn) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch


def index_batch(batch: Any, index: torch.Tensor) -> Any:
    """Keep the samples ``index`` of every tensor whose leading dimension is the batch size."""
    size = num_samples(batch)

    def take(t: torch.Tensor) -> torch.Tensor:
        return t[index.to(t.device)] if t.dim() and t.shape[0] == size else t

    return map_tensors(batch, take)
