"""Exponential moving average of the weights, used for evaluation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kiln.core.callback import Algorithm
from kiln.core.event import Event
from kiln.core.time import Time, TimeUnit

if TYPE_CHECKING:
    from kiln.core.state import State

__all__ = ["EMA"]


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


class EMA(Algorithm):
    """Keep ``ema = smoothing * ema + (1 - smoothing) * weights`` and evaluate with ``ema``.

    The average starts from the weights at ``FIT_START`` (or, with a later ``ema_start``, from the
    weights at that time) and is updated every ``update_interval``. At ``EVAL_START`` the averaged
    weights are copied into the model and at ``EVAL_END`` the training weights are put back, so
    training never sees the average. Buffers (BatchNorm statistics) are copied, not averaged. The
    averaged weights are in ``state_dict()``, so a resumed run continues the same average.

    Events: ``FIT_START``, ``BATCH_END`` (or ``EPOCH_END`` for epoch intervals), ``EVAL_START``,
    ``EVAL_END``.

    Args:
        half_life: the time after which an update's weight in the average has halved, in ``ba``
            or ``ep``; sets ``smoothing = 2 ** -(update_interval / half_life)``.
        smoothing: the decay per update, in ``[0, 1)``; when given it wins over ``half_life``.
        ema_start: when the average starts (``"0.0dur"``: at the start of training).
        update_interval: how often to update; defaults to ``1`` of ``half_life``'s unit (``"1ba"``
            with ``smoothing``).

    Example::

        ema = kiln.algorithms.EMA(half_life="100ba")
        trainer = kiln.Trainer(model, ..., algorithms=[ema])
        trainer.fit()
        ema.copy_to(model)   # keep the averaged weights after training
    """

    def __init__(
        self,
        half_life: str | Time | None = "1000ba",
        smoothing: float | None = None,
        ema_start: str | Time = "0.0dur",
        update_interval: str | Time | None = None,
    ) -> None:
        if smoothing is None and half_life is None:
            raise ValueError("EMA needs half_life= (e.g. '1000ba') or smoothing= (e.g. 0.999)")
        if smoothing is not None:
            if not 0.0 <= smoothing < 1.0:
                raise ValueError(f"EMA(smoothing={smoothing!r}): smoothing must be in [0, 1)")
            interval = Time.from_input(update_interval or "1ba", TimeUnit.BATCH)
        else:
            assert half_life is not None  # checked above: one of smoothing and half_life is given
            half = Time.from_input(half_life, TimeUnit.BATCH)
            interval = Time.from_input(update_interval or Time(1, half.unit), TimeUnit.BATCH)
            if half.unit != interval.unit:
                raise ValueError(
                    f"EMA(half_life={half}, update_interval={interval}): both must be in the same unit ('ba' or 'ep')"
                )
            if half.value <= 0:
                raise ValueError(f"EMA(half_life={half}): half_life must be positive")
            smoothing = 2.0 ** -(interval.value / half.value)
        if interval.unit not in (TimeUnit.BATCH, TimeUnit.EPOCH) or interval.value < 1:
            raise ValueError(
                f"EMA(update_interval={interval}): must be a positive number of batches ('1ba') or epochs ('1ep')"
            )
        self.smoothing = float(smoothing)
        self.update_interval = interval
        self.ema_start = Time.from_input(ema_start, TimeUnit.EPOCH)
        self._update_event = Event.BATCH_END if interval.unit == TimeUnit.BATCH else Event.EPOCH_END
        self.ema_weights: dict[str, torch.Tensor] | None = None
        self.started = False
        self._training_weights: dict[str, torch.Tensor] | None = None

    def match(self, event: Event, state: State) -> bool:
        return event in (Event.FIT_START, self._update_event, Event.EVAL_START, Event.EVAL_END)

    def apply(self, event: Event, state: State, logger: Any) -> None:
        if event == Event.FIT_START:
            tensors = _named_tensors(state.model)
            if self.ema_weights is None:  # not loaded from a checkpoint
                self.ema_weights = {k: v.detach().clone() for k, v in tensors.items()}
                self.started = self._after_start(state)
            else:  # a checkpoint may have been loaded onto the CPU
                self.ema_weights = {k: v.to(tensors[k].device) for k, v in self.ema_weights.items()}
        elif event == self._update_event:
            count = state.timestamp.get(self.update_interval.unit).value
            if self._after_start(state) and count % self.update_interval.value == 0:
                self._update(state.model)
        elif event == Event.EVAL_START:
            if self.started and self.ema_weights is not None:
                self._training_weights = {k: v.detach().clone() for k, v in _named_tensors(state.model).items()}
                self.copy_to(state.model)
        elif event == Event.EVAL_END and self._training_weights is not None:
            self._copy(self._training_weights, state.model)
            self._training_weights = None

    def _after_start(self, state: State) -> bool:
        return state.timestamp >= state.resolve(self.ema_start)

    @torch.no_grad()
    def _update(self, model: nn.Module) -> None:
        tensors = _named_tensors(model)
        if self.ema_weights is None or not self.started:
            # The first update after ema_start starts the average from the current weights.
            self.ema_weights = {k: v.detach().clone() for k, v in tensors.items()}
            self.started = True
            return
        weight = 1.0 - self.smoothing
        for name, tensor in tensors.items():
            average = self.ema_weights[name]
            if isinstance(tensor, nn.Parameter) and tensor.is_floating_point():
                average.lerp_(tensor.detach(), weight)  # = smoothing * average + (1 - smoothing) * tensor
            else:
                average.copy_(tensor)

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Copy the averaged weights into ``model`` (e.g. to keep them after training)."""
        if self.ema_weights is None:
            raise RuntimeError("EMA has no averaged weights yet: it starts at FIT_START")
        self._copy(self.ema_weights, model)

    @staticmethod
    @torch.no_grad()
    def _copy(source: dict[str, torch.Tensor], model: nn.Module) -> None:
        for name, tensor in _named_tensors(model).items():
            tensor.copy_(source[name])

    def state_dict(self) -> dict[str, Any]:
        return {"ema_weights": self.ema_weights, "started": self.started}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        weights = state.get("ema_weights")
        self.ema_weights = None if weights is None else {k: v.detach().clone() for k, v in weights.items()}
        self.started = bool(state.get("started", False))
