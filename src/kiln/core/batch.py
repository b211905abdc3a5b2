"""Counting the samples of a batch: one rule for the loop, the evaluator, algorithms and hooks."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["num_samples"]


def num_samples(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its first tensor that has one.

    The first tensor is found depth first, in order: a tuple's or list's items, a dict's values.
    Items that are not tensors (strings, ints, ``None``) and 0-dim tensors are passed over, so
    ``{"id": "a", "x": x}`` and ``(temperature, x)`` count the rows of ``x``. A batch whose
    tensors are all 0-dim (a bare scalar tensor included) is one sample.

    Raises:
        ValueError: the batch holds no tensor (an empty tuple, list or dict included).

    Example::

        num_samples((torch.zeros(8, 3), torch.zeros(8)))   # 8
        num_samples({"input_ids": torch.zeros(4, 128)})    # 4
    """
    # The common cases, (inputs, targets) and a bare tensor, checked without ABCs: this runs per batch.
    if type(batch) in (tuple, list) and batch and type(batch[0]) is torch.Tensor and batch[0].dim():
        return batch[0].shape[0]
    if type(batch) is torch.Tensor and batch.dim():
        return batch.shape[0]
    scalar = False
    for tensor in _tensors(batch):
        if tensor.dim():
            return int(tensor.shape[0])
        scalar = True
    if scalar:
        return 1
    raise ValueError(f"cannot count the samples of a batch of type {type(batch).__name__}: it holds no tensor; "
                     "expected a tensor, an (inputs, targets) tuple or a dict of tensors")


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    """The tensors of a nested tuple/list/dict batch, depth first, in order."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, (tuple, list)):
        for item in batch:
            yield from _tensors(item)
