"""Batches: counting tokens, splitting into microbatches (samples are counted by :mod:`kiln.core.batch`)."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from kiln.core.batch import num_samples  # re-exported: the rule lives in kiln.core.batch

__all__ = ["num_samples", "num_tokens", "split_batch"]


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
