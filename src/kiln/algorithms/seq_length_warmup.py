"""Sequence length warmup (Li et al., 2022): train language models on short sequences first."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from kiln.core.callback import Algorithm
from kiln.core.event import Event

if TYPE_CHECKING:
    from kiln.core.state import State

__all__ = ["SeqLengthWarmup", "warmup_seq_length"]


def warmup_seq_length(elapsed: float, duration: float, min_seq_length: int, max_seq_length: int, step_size: int) -> int:
    """The sequence length at ``elapsed`` (a fraction of the run): from ``min_seq_length`` up to
    ``max_seq_length`` linearly over the first ``duration`` of training, in steps of ``step_size``."""
    progress = 1.0 if duration <= 0 else min(1.0, elapsed / duration)
    length = min_seq_length + step_size * int(progress * (max_seq_length - min_seq_length) / step_size)
    return min(max_seq_length, length)


def _sequence_length(batch: Any) -> int:
    if isinstance(batch, Mapping):
        first = batch.get("input_ids", next(iter(batch.values())))
    else:
        first = batch[0]
    if not isinstance(first, torch.Tensor) or first.dim() < 2:
        raise ValueError(
            "SeqLengthWarmup needs token batches shaped (N, L): a dict with input_ids or a tuple whose "
            f"first item is such a tensor, got {type(first).__name__}"
        )
    return int(first.shape[1])


class SeqLengthWarmup(Algorithm):
    """Cut training sequences short early in training, growing them to full length.

    Short sequences make the first steps cheaper and more stable (fewer loss spikes with large
    batches and learning rates). Every tensor in the batch whose second dimension is the sequence
    length (``input_ids``, ``attention_mask``, ``labels``, ...) is cut to the current length: with
    ``truncate=True`` the ends are dropped; with ``False`` each row is split into rows of the
    current length (2-D tensors only; a remainder that does not fill a row is dropped), which keeps
    all tokens at the price of crossing sample boundaries.

    Events: ``BEFORE_TRAIN_BATCH`` (the whole batch, before it is split into microbatches).

    Args:
        duration: the fraction of training over which the length grows.
        min_seq_length, max_seq_length: the first and the final length.
        step_size: lengths are multiples of this above ``min_seq_length`` (8 suits tensor cores).
        truncate: drop the tail (True) or reshape into more, shorter rows (False).

    Example::

        algorithms = [kiln.algorithms.SeqLengthWarmup(duration=0.3, min_seq_length=64, max_seq_length=1024)]
    """

    def __init__(
        self,
        duration: float = 0.3,
        min_seq_length: int = 8,
        max_seq_length: int = 1024,
        step_size: int = 8,
        truncate: bool = True,
    ) -> None:
        if not 0.0 <= duration <= 1.0:
            raise ValueError(f"SeqLengthWarmup(duration={duration!r}): must be a fraction of training in [0, 1]")
        if not 0 < min_seq_length <= max_seq_length:
            raise ValueError(
                f"SeqLengthWarmup(min_seq_length={min_seq_length!r}, max_seq_length={max_seq_length!r}): "
                "need 0 < min_seq_length <= max_seq_length"
            )
        if step_size < 1:
            raise ValueError(f"SeqLengthWarmup(step_size={step_size!r}): must be >= 1")
        self.duration = duration
        self.min_seq_length = min_seq_length
        self.max_seq_length = max_seq_length
        self.step_size = step_size
        self.truncate = truncate
        self.seq_length = min_seq_length

    def match(self, event: Event, state: State) -> bool:
        return event == Event.BEFORE_TRAIN_BATCH

    def apply(self, event: Event, state: State, logger: Any) -> None:
        elapsed = state.get_elapsed_duration()
        if elapsed is None:
            raise ValueError("SeqLengthWarmup needs the run's max_duration to know how far training is")
        self.seq_length = warmup_seq_length(
            elapsed, self.duration, self.min_seq_length, self.max_seq_length, self.step_size
        )
        full = _sequence_length(state.batch)
        if self.seq_length >= full:
            return
        state.batch = self._cut(state.batch, full, self.seq_length)

    def _cut(self, batch: Any, full: int, length: int) -> Any:
        def cut(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[1] != full:
                return t
            if self.truncate:
                return t[:, :length]
            if t.dim() != 2:
                raise ValueError(f"SeqLengthWarmup(truncate=False) reshapes 2-D tensors only, got {tuple(t.shape)}")
            flat = t.reshape(-1)
            usable = flat.shape[0] // length * length
            return flat[:usable].view(-1, length)

        if isinstance(batch, Mapping):
            return type(batch)(  # type: ignore[call-arg]  # its own mapping class, which takes a dict
                {k: cut(v) for k, v in batch.items()}
            )
        return type(batch)(cut(v) for v in batch)
