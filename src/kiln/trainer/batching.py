"""Batches: counting samples and tokens, and splitting into microbatches."""

from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["num_samples", "num_tokens", "split_batch"]


def num_samples(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its first tensor."""
    if type(batch) in (tuple, list) and batch and type(batch[0]) is torch.Tensor and batch[0].dim():
        return batch[0].shape[0]  # the common (inputs, targets) case, checked without ABCs: per batch
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, (list, tuple)) and batch:
        return num_samples(batch[0])
    if isinstance(batch, Mapping) and batch:
        return num_samples(next(iter(batch.values())))
    raise TypeError(f"cannot count samples in a batch of type {type(batch).__name__}; "
                    "expected a tensor, a (inputs, targets) tuple or a dict of tensors")


def num_tokens(batch: Any) -> int:
    """Tokens in a batch: ``input_ids.numel()`` for dict batches with input_ids, else 0."""
    if type(batch) in (tuple, list):
        return 0
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
        return batch["input_ids"].numel()
    return 0


def split_batch(batch: Any, microbatch_size: int) -> list[Any]:
    """Split every tensor of ``batch`` along dim 0 into pieces of ``microbatch_size``."""
    if isinstance(batch, torch.Tensor):
        return list(batch.split(microbatch_size))
    if isinstance(batch, (list, tuple)):
        parts = [split_batch(item, microbatch_size) for item in batch]
        count = max(len(p) for p in parts)
        return [type(batch)(p[i] if len(p) > 1 else p[0] for p in parts) for i in range(count)]
    if isinstance(batch, Mapping):
        parts = {k: split_batch(v, microbatch_size) for k, v in batch.items()}
        count = max(len(p) for p in parts.values())
        return [type(batch)({k: p[i] if len(p) > 1 else p[0] for k, p in parts.items()}) for i in range(count)]
    return [batch]  # a non-tensor leaf (e.g. a string) is shared by every microbatch
