"""Batches: counting their samples and tokens, splitting them into microbatches, and weighting the
microbatches of one step. One rule each for the loop, the Engine, the evaluator, algorithms and hooks."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

__all__ = ["IGNORE_INDEX", "num_samples", "num_tokens", "split_batch", "microbatch_weights", "WEIGHTINGS"]

# The label value of positions that count in no loss or metric (transformers' and torch's -100):
# one home for the language models, their metrics and context parallelism's label shifting.
IGNORE_INDEX = -100


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
    raise ValueError(
        f"cannot count the samples of a batch of type {type(batch).__name__}: it holds no tensor; "
        "expected a tensor, an (inputs, targets) tuple or a dict of tensors"
    )


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
        fields = {k: split_batch(v, microbatch_size) for k, v in batch.items()}
        count = max(len(p) for p in fields.values())
        pieces = [{k: p[i] if len(p) > 1 else p[0] for k, p in fields.items()} for i in range(count)]
        return [type(batch)(piece) for piece in pieces]  # type: ignore[call-arg]  # its own mapping class, which takes a dict
    return [batch]  # a non-tensor leaf (e.g. a string) is shared by every microbatch


WEIGHTINGS = ("samples", "sum", "tokens")
"""How the microbatch losses of one step add up to the step's loss (see :func:`microbatch_weights`)."""


def microbatch_weights(microbatches: Sequence[Any], weighting: str | Sequence[float]) -> list[float] | None:
    """The factor each microbatch's loss is multiplied by before its backward.

    - ``"samples"``: its share of the step's samples, so that mean losses add up to the mean over
      the whole batch (what one unsplit batch gives);
    - ``"sum"``: 1 each, the plain sum (nnScaler's ``grad_reduction: sum`` scales the result itself);
    - ``"tokens"``: its share of the step's tokens (``input_ids``), for per-token mean losses;
    - a sequence of floats: those factors.

    Returns None where every factor is 1 (one microbatch weighted by samples or sum), so the
    backward multiplies by nothing, as a plain loop would.

    Example::

        microbatch_weights([(torch.zeros(3, 2),), (torch.zeros(1, 2),)], "samples")   # [0.75, 0.25]
    """
    if not isinstance(weighting, str):
        weights = [float(w) for w in weighting]
        if len(weights) != len(microbatches):
            raise ValueError(
                f"weighting has {len(weights)} factors for {len(microbatches)} microbatches; "
                "give one factor per microbatch"
            )
        return weights
    if weighting == "samples":
        if len(microbatches) == 1:
            return None
        sizes = [num_samples(mb) for mb in microbatches]
        total = sum(sizes)
        return [size / total for size in sizes]
    if weighting == "sum":
        return None if len(microbatches) == 1 else [1.0] * len(microbatches)
    if weighting == "tokens":
        tokens = [num_tokens(mb) for mb in microbatches]
        total = sum(tokens)
        if total == 0:
            raise ValueError(
                "weighting='tokens' needs dict microbatches with an 'input_ids' tensor; these hold no "
                "tokens: use weighting='samples'"
            )
        return [count / total for count in tokens]
    raise ValueError(f"weighting={weighting!r}: expected one of {', '.join(WEIGHTINGS)} or a list of floats")
