"""Stochastic Weight Averaging (Izmailov et al., 2018) with ``torch.optim.swa_utils.AveragedModel``."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.swa_utils import AveragedModel

from kiln.core.callback import Algorithm
from kiln.core.event import Event
from kiln.core.time import Time, TimeUnit

if TYPE_CHECKING:
    from kiln.core.state import State

__all__ = ["SWA"]


class SWA(Algorithm):
    """Average the weights seen between ``swa_start`` and ``swa_end``; then train on from the average.

    From ``swa_start`` on, an :class:`~torch.optim.swa_utils.AveragedModel` (buffers averaged too,
    so BatchNorm statistics need no extra pass) takes the equal-weight average of the model every
    ``update_interval``. At ``swa_end`` the average is copied into the model; use ``swa_end="1dur"``
    to finish training on exactly the average. With ``swa_lr`` the learning rate is annealed from
    its value at ``swa_start`` to ``swa_lr`` over ``anneal_epochs`` updates and held there (it
    overrides any scheduler from then on, as torch's ``SWALR`` does). The averaged model and the
    starting learning rates are in ``state_dict()``.

    Events: ``BATCH_START`` (learning rate), ``BATCH_END`` / ``EPOCH_END`` (average, finish).

    Args:
        swa_start, swa_end: when averaging starts and when the average is copied into the model.
        update_interval: how often to add the weights to the average (``"1ep"`` or ``"Nba"``).
        swa_lr: the learning rate to anneal to; ``None`` leaves the schedule alone.
        anneal_epochs: number of updates over which to anneal to ``swa_lr``.
        anneal_strategy: ``"linear"`` or ``"cos"``.

    Example::

        swa = kiln.algorithms.SWA(swa_start="0.75dur", swa_end="1dur", swa_lr=0.01)
        trainer = kiln.Trainer(model, ..., max_duration="40ep", algorithms=[swa])
    """

    def __init__(
        self,
        swa_start: str | Time = "0.7dur",
        swa_end: str | Time = "0.97dur",
        update_interval: str | Time = "1ep",
        swa_lr: float | None = None,
        anneal_epochs: int = 10,
        anneal_strategy: str = "linear",
    ) -> None:
        self.swa_start = Time.from_input(swa_start, TimeUnit.EPOCH)
        self.swa_end = Time.from_input(swa_end, TimeUnit.EPOCH)
        if self.swa_start.unit == self.swa_end.unit and self.swa_end < self.swa_start:
            raise ValueError(
                f"SWA(swa_start={self.swa_start}, swa_end={self.swa_end}): swa_end must not come before swa_start"
            )
        self.update_interval = Time.from_input(update_interval, TimeUnit.EPOCH)
        if self.update_interval.unit not in (TimeUnit.BATCH, TimeUnit.EPOCH) or self.update_interval.value < 1:
            raise ValueError(
                f"SWA(update_interval={self.update_interval}): must be a positive number of batches or epochs"
            )
        if anneal_strategy not in ("linear", "cos"):
            raise ValueError(f"SWA(anneal_strategy={anneal_strategy!r}): expected 'linear' or 'cos'")
        if swa_lr is not None and swa_lr < 0:
            raise ValueError(f"SWA(swa_lr={swa_lr!r}): must be >= 0")
        if anneal_epochs < 0:
            raise ValueError(f"SWA(anneal_epochs={anneal_epochs!r}): must be >= 0")
        self.swa_lr = swa_lr
        self.anneal_epochs = anneal_epochs
        self.anneal_strategy = anneal_strategy
        self.swa_model: AveragedModel | None = None
        self.completed = False
        self._start_lrs: list[float] | None = None
        self._pending: dict[str, Any] | None = None  # a loaded average, applied once the model is known

    def match(self, event: Event, state: State) -> bool:
        return event in (Event.BATCH_START, Event.BATCH_END, Event.EPOCH_END)

    def apply(self, event: Event, state: State, logger: Any) -> None:
        started = state.timestamp >= state.resolve(self.swa_start)
        if not started:
            return
        model = self._averaged(state)
        if self._start_lrs is None:  # the rates the annealing starts from
            self._start_lrs = [group["lr"] for opt in state.optimizers for group in opt.param_groups]
        update_event = Event.BATCH_END if self.update_interval.unit == TimeUnit.BATCH else Event.EPOCH_END
        if event == update_event and not self.completed:
            count = state.timestamp.get(self.update_interval.unit).value
            if count % self.update_interval.value == 0:
                model.update_parameters(state.model)
        if event != Event.BATCH_START and not self.completed and state.timestamp >= state.resolve(self.swa_end):
            if int(model.n_averaged) > 0:
                self._copy_average(model, state.model)
                self.completed = True
        if self.swa_lr is not None and self._start_lrs is not None:
            # Set after the schedulers stepped (BATCH_END) and again before the step (BATCH_START):
            # a function of the update count, so a resumed run sets the same rates.
            self._set_lr(state, int(model.n_averaged))

    def _averaged(self, state: State) -> AveragedModel:
        if self.swa_model is None:
            self.swa_model = AveragedModel(state.model, use_buffers=True)
            if self._pending is not None:
                self.swa_model.load_state_dict(self._pending)
                self._pending = None
        return self.swa_model

    @staticmethod
    @torch.no_grad()
    def _copy_average(averaged: AveragedModel, model: torch.nn.Module) -> None:
        for target, source in zip(
            [*model.parameters(), *model.buffers()], [*averaged.module.parameters(), *averaged.module.buffers()]
        ):
            target.copy_(source)

    def _set_lr(self, state: State, num_updates: int) -> None:
        assert self._start_lrs is not None and self.swa_lr is not None
        progress = 1.0 if self.anneal_epochs == 0 else min(1.0, num_updates / self.anneal_epochs)
        if self.anneal_strategy == "cos":
            progress = (1.0 - math.cos(math.pi * progress)) / 2.0
        groups = [group for opt in state.optimizers for group in opt.param_groups]
        for group, start_lr in zip(groups, self._start_lrs):
            group["lr"] = (1.0 - progress) * start_lr + progress * self.swa_lr

    def state_dict(self) -> dict[str, Any]:
        average = self.swa_model.state_dict() if self.swa_model is not None else self._pending
        return {"swa_model": average, "completed": self.completed, "start_lrs": self._start_lrs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.completed = bool(state.get("completed", False))
        self._start_lrs = state.get("start_lrs")
        average = state.get("swa_model")
        if average is not None and self.swa_model is not None:
            self.swa_model.load_state_dict(average)
        else:
            self._pending = average
