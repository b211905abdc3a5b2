"""`State`: everything the loop knows, shared with algorithms, callbacks and loggers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn

from kiln.core.time import Time, Timestamp, TimeUnit, resolve_fraction

if TYPE_CHECKING:
    from kiln.core.callback import Algorithm, Callback

__all__ = ["State"]


class State:
    """The training run's state.

    Attributes:
        model: the user's module (unwrapped; ``state.engine.model`` is what the strategy wraps).
        optimizers: list of optimizers. ``state.optimizer`` is the first.
        schedulers: list of LR schedulers (stepped by the Trainer).
        timestamp: a :class:`kiln.Timestamp`; advances before ``BATCH_END``.
        max_duration: a :class:`kiln.Time` or None.
        batch, outputs, loss: the current (micro)batch, its outputs and loss.
        precision: the :class:`kiln.precision.Precision`.
        train_metrics, eval_metrics: dicts of torchmetrics metrics.
        metrics: the latest logged values, e.g. ``{"eval/loss": 0.1}``.
        dataloader: the training dataloader; ``dataloader_len`` its length (None if unknown).
        rank, world_size: where this process runs.
        algorithms, callbacks: what runs on events.

    Example::

        class StopAt(kiln.Callback):
            def batch_end(self, state, logger):
                if state.timestamp.batch.value >= 10:
                    state.stop_training()
    """

    def __init__(self, model: nn.Module, *, rank: int = 0, world_size: int = 1, max_duration: Time | None = None,
                 optimizers: Sequence[torch.optim.Optimizer] = (), schedulers: Sequence[Any] = (),
                 precision: Any = None, device: torch.device | None = None, seed: int | None = None,
                 algorithms: Sequence[Algorithm] = (), callbacks: Sequence[Callback] = (), run_name: str = "kiln") -> None:
        self.model = model
        self.rank = rank
        self.world_size = world_size
        self.max_duration = max_duration
        self.optimizers = list(optimizers)
        self.schedulers = list(schedulers)
        self.precision = precision
        self.device = device or torch.device("cpu")
        self.seed = seed
        self.algorithms = list(algorithms)
        self.callbacks = list(callbacks)
        self.run_name = run_name
        self.timestamp = Timestamp()
        self.batch: Any = None
        self.outputs: Any = None
        self.loss: Any = None
        self.train_metrics: dict[str, Any] = {}
        self.eval_metrics: dict[str, dict[str, Any]] = {}
        self.metrics: dict[str, float] = {}
        self.dataloader: Any = None
        self.dataloader_len: int | None = None
        self.eval_dataloader: Any = None
        self.grad_accum = 1
        self.engine: Any = None
        self.stop_reason: str | None = None
        self._stop = False

    # -- conveniences -----------------------------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.optimizers[0] if self.optimizers else None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def stop_training(self, reason: str = "stop_training() was called") -> None:
        """End the run cleanly after the current batch (the final checkpoint is still written)."""
        self._stop = True
        self.stop_reason = reason

    @property
    def stopped(self) -> bool:
        return self._stop

    def resolve(self, time: Time | str | int) -> Time:
        """A Time in a countable unit: ``dur`` fractions resolve against ``max_duration``."""
        time = Time.from_input(time)
        if time.unit == TimeUnit.DURATION:
            if self.max_duration is None:
                raise ValueError(f"{time} is a fraction of max_duration, but the run has no max_duration")
            return resolve_fraction(time, self.max_duration)
        return time

    def get_elapsed_duration(self) -> float | None:
        """The fraction of ``max_duration`` done, in [0, 1]; None without a max_duration."""
        if self.max_duration is None:
            return None
        elapsed = self.timestamp.get(self.max_duration.unit).value
        return min(1.0, elapsed / self.max_duration.value) if self.max_duration.value else 1.0

    @property
    def lr(self) -> float | None:
        opt = self.optimizer
        return None if opt is None else float(opt.param_groups[0]["lr"])

    def __repr__(self) -> str:
        return f"State(timestamp={self.timestamp!r}, max_duration={self.max_duration!r})"
