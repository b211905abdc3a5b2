"""`State`: everything the loop knows, shared with algorithms, callbacks and loggers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kiln.core.time import Time, Timestamp, TimeUnit, resolve_fraction

__all__ = ["State"]


# A dataclass only for its declared, typed fields and the __slots__ made from them: setting an
# attribute that is not declared here raises AttributeError, so everything the Trainer, checkpoints
# and callbacks keep on the State is listed in one place. __init__ stays hand-written (keyword
# arguments that are not fields), and equality stays identity.
@dataclass(slots=True, init=False, repr=False, eq=False)
class State:
    """The training run's state: each field below is documented where it is declared.

    Every attribute is declared (an undeclared one raises AttributeError); fields with a leading
    underscore are written only by ``kiln.core``. Callbacks added to a running Trainer go through
    ``trainer.events.add(callback)``, which also appends them to ``callbacks``.

    Example::

        class StopAt(kiln.Callback):
            def batch_end(self, state, logger):
                if state.timestamp.batch.value >= 10:
                    state.stop_training()
    """

    # -- the run's components ---------------------------------------------------------------
    model: nn.Module
    """The user's module, unwrapped (``state.engine.model`` is what the strategy wraps)."""
    optimizers: list[torch.optim.Optimizer]
    """The optimizers; ``state.optimizer`` is the first."""
    schedulers: list[Any]
    """The LR schedulers (stepped by the Trainer)."""
    precision: Any
    """The :class:`kiln.precision.Precision` the engine computes in (None outside a Trainer)."""
    engine: Any
    """The :class:`kiln.Engine` that runs the model under its strategy (None outside a Trainer)."""
    loss_fn: Callable[[Any, Any], Any] | None
    """The loss of ``(outputs, batch)`` the Trainer computes; algorithms that rerun the forward call it."""
    # kiln.Algorithm and kiln.Callback objects: typed Any because core/callback.py, whose methods
    # take a State, imports this file (the State only holds them; the loop's events call them).
    algorithms: list[Any]
    """Algorithms, run first on each event."""
    callbacks: list[Any]
    """Callbacks, run after the algorithms; add or remove them with ``trainer.events.add``/``remove``."""
    # -- where and how it runs ----------------------------------------------------------------
    rank: int
    """This process's global rank."""
    world_size: int
    """The number of processes in the run."""
    device: torch.device
    """The device the model and batches are on."""
    seed: int | None
    """The run's seed (None: not seeded)."""
    run_name: str
    """The run's name, recorded in checkpoint manifests."""
    config: dict[str, Any] | None
    """The run's configuration, recorded in each checkpoint's manifest (None: the launch context's)."""
    grad_accum: int
    """The number of microbatches a batch is split into."""
    microbatch_weighting: str
    """How a step's microbatch losses add up: "samples" (the mean), "sum" or "tokens" (see kiln.core.batch)."""
    # -- time -----------------------------------------------------------------------------------
    _timestamp: Timestamp
    """The run's one Timestamp (see the ``timestamp`` property)."""
    max_duration: Time | None
    """When ``fit()`` ends (None until given)."""
    # -- the current batch ------------------------------------------------------------------------
    batch: Any
    """The current (micro)batch."""
    outputs: Any
    """The model's outputs for ``batch``."""
    loss: Any
    """The training loss of ``batch`` (after ``AFTER_TRAIN_BATCH``: of the whole batch)."""
    eval_loss: Any
    """The loss of the current evaluation batch (from ``EVAL_AFTER_FORWARD``)."""
    # -- metrics and data -----------------------------------------------------------------------
    train_metrics: dict[str, Any]
    """Training metrics (torchmetrics), by name."""
    eval_metrics: dict[str, dict[str, Any]]
    """Evaluation metrics (torchmetrics), by evaluation label, then name."""
    metrics: dict[str, Any]
    """The latest logged values, e.g. ``{"eval/loss": 0.1}``."""
    dataloader: Any
    """The training dataloader (the Trainer's: a ``kiln.ResumableLoader``, which a checkpoint positions)."""
    dataloader_len: int | None
    """Batches per training epoch (None if unknown)."""
    eval_dataloader: Any
    """The dataloader of the evaluation running now, or of the last one."""
    # -- resuming and stopping --------------------------------------------------------------------
    stop_reason: str | None
    """Why ``stop_training()`` was called (None: it was not)."""
    _stop: bool
    """Set by ``stop_training()``; the loop reads it after each batch."""

    def __init__(
        self,
        model: nn.Module,
        *,
        rank: int = 0,
        world_size: int = 1,
        max_duration: Time | None = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        schedulers: Sequence[Any] = (),
        precision: Any = None,
        device: torch.device | None = None,
        seed: int | None = None,
        algorithms: Sequence[Any] = (),
        callbacks: Sequence[Any] = (),
        run_name: str = "kiln",
    ) -> None:
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
        self.config = None
        self._timestamp = Timestamp()
        self.batch = None
        self.outputs = None
        self.loss = None
        self.eval_loss = None
        self.train_metrics = {}
        self.eval_metrics = {}
        self.metrics = {}
        self.dataloader = None
        self.dataloader_len = None
        self.eval_dataloader = None
        self.grad_accum = 1
        self.microbatch_weighting = "samples"
        self.engine = None
        self.loss_fn = None
        self.stop_reason = None
        self._stop = False

    # -- conveniences -----------------------------------------------------------------------
    @property
    def timestamp(self) -> Timestamp:
        """Where the run is: epoch, batch, sample, token; advances before ``BATCH_END``.

        Assigning a Timestamp (Composer's ``state.timestamp = state.timestamp.to_next_batch()``)
        sets the run's clock to its values: the loop, the schedulers and the checkpoints hold this
        one object, so a callback that moves the time at ``FIT_START`` or between batches moves
        the run's time, and training continues from there.
        """
        return self._timestamp

    @timestamp.setter
    def timestamp(self, value: Timestamp) -> None:
        if not isinstance(value, Timestamp):
            raise TypeError(f"state.timestamp must be a kiln Timestamp, got {type(value).__name__}")
        if value is not self._timestamp:
            self._timestamp.load_state_dict(value.state_dict())

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

    def clear_stop(self) -> None:
        """Forget an earlier ``stop_training()`` (``fit()`` calls this as it starts, so a stopped run can go on)."""
        self._stop = False
        self.stop_reason = None

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
