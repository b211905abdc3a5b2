"""Selective backprop (Jiang et al., 2019): train each step on the samples with the highest loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from kiln.algorithms._batch import Key, get_item, index_batch, map_tensors, num_samples, set_item
from kiln.algorithms._forward import compute_loss, forward
from kiln.core.callback import Algorithm
from kiln.core.event import Event

if TYPE_CHECKING:
    from kiln.core.state import State

__all__ = ["SelectiveBackprop", "should_select"]


def should_select(elapsed: float, batch_index: int, start: float, end: float, interrupt: int) -> bool:
    """Whether batch ``batch_index`` at ``elapsed`` (a fraction of the run) is pruned: inside
    ``[start, end)`` and not one of the full batches every ``interrupt`` batches."""
    return start <= elapsed < end and (interrupt == 0 or (batch_index + 1) % interrupt != 0)


class SelectiveBackprop(Algorithm):
    """Score a batch with a cheap forward pass and train only on its highest-loss fraction.

    Between ``start`` and ``end`` of training, before the batch is split into microbatches, a
    no-grad forward in eval mode (so dropout and stochastic depth stay off and BatchNorm
    statistics untouched) gives each sample's loss; the ``max(1, int(keep * N))`` samples with the
    highest loss are kept, in their original order, and the rest are dropped from ``state.batch``.
    Easy samples then cost a forward instead of a forward and backward. Every ``interrupt``-th
    batch trains on the whole batch (``0``: never), so that easy samples are not forgotten.
    ``scale_factor < 1`` scores downscaled images to make scoring cheaper.

    Per-sample losses come from ``per_sample_loss(outputs, batch)`` when given; otherwise the
    run's loss function is applied to each sample (vectorised with ``torch.func.vmap`` where it
    allows, one sample at a time where not).

    Events: ``BEFORE_TRAIN_BATCH``.

    Args:
        start, end: the fractions of training between which batches are pruned.
        keep: the fraction of each batch kept, in ``(0, 1]``.
        scale_factor: scale images (``(N, C, H, W)`` inputs) by this for scoring, in ``(0, 1]``.
        interrupt: every ``interrupt``-th batch is left whole; ``0`` for none.
        per_sample_loss: optional ``(outputs, batch) -> (N,)`` tensor of losses.
        input_key: where the inputs are in the batch (for ``scale_factor``).

    Example::

        algorithms = [kiln.algorithms.SelectiveBackprop(start=0.5, end=0.9, keep=0.5)]
    """

    def __init__(
        self,
        start: float = 0.5,
        end: float = 0.9,
        keep: float = 0.5,
        scale_factor: float = 1.0,
        interrupt: int = 2,
        per_sample_loss: Callable[[Any, Any], torch.Tensor] | None = None,
        *,
        input_key: Key = 0,
    ) -> None:
        if not 0.0 <= start <= end <= 1.0:
            raise ValueError(f"SelectiveBackprop(start={start!r}, end={end!r}): need 0 <= start <= end <= 1")
        if not 0.0 < keep <= 1.0:
            raise ValueError(f"SelectiveBackprop(keep={keep!r}): must be in (0, 1]")
        if not 0.0 < scale_factor <= 1.0:
            raise ValueError(f"SelectiveBackprop(scale_factor={scale_factor!r}): must be in (0, 1]")
        if not isinstance(interrupt, int) or interrupt < 0:
            raise ValueError(f"SelectiveBackprop(interrupt={interrupt!r}): must be an integer >= 0")
        self.start, self.end, self.keep = start, end, keep
        self.scale_factor = scale_factor
        self.interrupt = interrupt
        self.per_sample_loss = per_sample_loss
        self.input_key = input_key
        self.kept_indices: torch.Tensor | None = None

    def match(self, event: Event, state: State) -> bool:
        if event != Event.BEFORE_TRAIN_BATCH:
            return False
        elapsed = state.get_elapsed_duration()
        if elapsed is None:
            raise ValueError("SelectiveBackprop needs the run's max_duration to know how far training is")
        return should_select(elapsed, state.timestamp.batch.value, self.start, self.end, self.interrupt)

    def apply(self, event: Event, state: State, logger: Any) -> None:
        batch = state.batch
        size = num_samples(batch)
        count = max(1, int(self.keep * size))
        if count >= size:
            return
        losses = self.score(state, batch)
        kept = torch.topk(losses.detach().float(), count).indices.sort().values
        self.kept_indices = kept
        state.batch = index_batch(batch, kept)

    @torch.no_grad()
    def score(self, state: State, batch: Any) -> torch.Tensor:
        """Each sample's loss under the current weights, shape ``(N,)``."""
        scoring = batch
        if self.scale_factor < 1.0:
            inputs = get_item(batch, self.input_key)
            scoring = set_item(
                batch,
                self.input_key,
                F.interpolate(inputs, scale_factor=self.scale_factor, mode="bilinear", align_corners=False),
            )
        module = state.engine.model if state.engine is not None else state.model
        was_training = module.training
        module.eval()
        try:
            outputs = forward(state, scoring)
            if self.per_sample_loss is not None:
                return self.per_sample_loss(outputs, scoring)
            return _per_sample(lambda o, b: compute_loss(state, o, b), outputs, scoring)
        finally:
            module.train(was_training)


def _per_sample(loss_fn: Callable[[Any, Any], torch.Tensor], outputs: Any, batch: Any) -> torch.Tensor:
    size = num_samples(batch)

    def one(t: Any) -> Any:  # a single sample, with its batch dimension of 1
        return t.unsqueeze(0) if isinstance(t, torch.Tensor) else t

    try:
        dims = map_tensors(batch, lambda t: 0 if t.dim() and t.shape[0] == size else None)
        return torch.func.vmap(lambda o, b: loss_fn(one(o), map_tensors(b, one)), in_dims=(0, dims))(outputs, batch)
    except Exception:  # noqa: BLE001 -- a loss vmap cannot trace (.item(), data-dependent shapes): one by one
        return torch.stack(
            [loss_fn(outputs[i : i + 1], index_batch(batch, torch.tensor([i]))).reshape(()) for i in range(size)]
        )
