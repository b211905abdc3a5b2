"""Sharpness-Aware Minimization (Foret et al., 2021): step with the gradient at a nearby worst point."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kiln.algorithms._forward import compute_loss, forward
from kiln.core.batch import microbatch_weights
from kiln.core.callback import Algorithm
from kiln.core.event import Event

if TYPE_CHECKING:
    from kiln.core.state import State

__all__ = ["SAM"]


class SAM(Algorithm):
    """Replace the gradient ``g(w)`` by ``g(w + e)`` with ``e = rho * g(w) / ||g(w)||``.

    Once the batch's gradients are complete (``AFTER_TRAIN_BATCH``), SAM moves the weights by
    ``e``, runs forward, loss and backward again on the same microbatches as the loss saw them
    (after other algorithms changed them; no events fire in this second pass), and puts the
    weights back. The optimizer then steps from ``w`` with the gradient taken at ``w + e``: twice
    the compute per step, usually better generalisation. ``interval=k`` does this on every k-th
    batch only. A step whose gradient is not finite (an fp16 overflow the scaler will skip) is
    left alone. The second pass uses ``state.loss_fn``, so SAM does not combine with a
    loss-interpolating algorithm (``check_algorithm_compatibility`` refuses it).

    Events: ``BEFORE_TRAIN_BATCH`` (reset), ``BEFORE_BACKWARD`` (record microbatches),
    ``AFTER_TRAIN_BATCH`` (the ascent step and second pass).

    Args:
        rho: the radius of the neighbourhood.
        epsilon: added to the gradient norm to avoid dividing by zero.
        interval: apply SAM every ``interval`` batches.

    Example::

        algorithms = [kiln.algorithms.SAM(rho=0.05)]
    """

    def __init__(self, rho: float = 0.05, epsilon: float = 1e-12, interval: int = 1) -> None:
        if not rho > 0:
            raise ValueError(f"SAM(rho={rho!r}): rho must be > 0")
        if not epsilon >= 0:
            raise ValueError(f"SAM(epsilon={epsilon!r}): epsilon must be >= 0")
        if not isinstance(interval, int) or interval < 1:
            raise ValueError(f"SAM(interval={interval!r}): interval must be an integer >= 1")
        self.rho = rho
        self.epsilon = epsilon
        self.interval = interval
        self._microbatches: list[Any] = []

    def match(self, event: Event, state: State) -> bool:
        return event in (Event.BEFORE_TRAIN_BATCH, Event.BEFORE_BACKWARD, Event.AFTER_TRAIN_BATCH)

    def apply(self, event: Event, state: State, logger: Any) -> None:
        if event == Event.BEFORE_TRAIN_BATCH:
            self._microbatches = []
        elif event == Event.BEFORE_BACKWARD:
            self._microbatches.append(state.batch)
        elif event == Event.AFTER_TRAIN_BATCH:
            microbatches, self._microbatches = self._microbatches, []
            if microbatches and state.timestamp.batch.value % self.interval == 0:
                self._sam_step(state, microbatches)

    def _sam_step(self, state: State, microbatches: list[Any]) -> None:
        params = [p for p in state.model.parameters() if p.grad is not None]
        if not params:
            return
        grads = [p.grad for p in params if p.grad is not None]  # all of them (typed without None)
        # The direction g/||g|| is the same for fp16-scaled gradients, so no unscaling is needed.
        norm = torch.nn.utils.get_total_norm(grads)
        if not torch.isfinite(norm):
            return
        scale = self.rho / (norm + self.epsilon)
        with torch.no_grad():
            originals = [p.detach().clone() for p in params]
            for p, grad in zip(params, grads):
                p.add_(grad * scale.to(grad.dtype))
        for optimizer in state.optimizers:
            optimizer.zero_grad(set_to_none=True)
        self._second_pass(state, microbatches)
        with torch.no_grad():
            for p, original in zip(params, originals):
                p.copy_(original)

    @staticmethod
    def _second_pass(state: State, microbatches: list[Any]) -> None:
        # Through the Engine's own microbatch backward: the same weights as the first pass
        # (state.microbatch_weighting), gradient sync only on the last backward.
        def loss_of(microbatch: Any) -> torch.Tensor:
            return compute_loss(state, forward(state, microbatch), microbatch)

        engine = state.engine
        if engine is not None:
            engine.backward_microbatches(microbatches, loss_of, weighting=state.microbatch_weighting)
            return
        weights = microbatch_weights(microbatches, state.microbatch_weighting)  # a hand-built State
        for index, microbatch in enumerate(microbatches):
            loss = loss_of(microbatch)
            (loss if weights is None else loss * weights[index]).backward()
