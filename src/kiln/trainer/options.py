"""The Trainer's arguments, grouped and validated, and the small decisions the loop asks of them
(is evaluation due, what microbatch size, how often to log).

Each group is a dataclass whose fields carry the Trainer's argument names and whose
``__post_init__`` checks them, so a bad value fails when the Trainer is built, with one line that
names the argument, the value and what was expected. Each rule is written once: rules that belong
to another layer (the checkpoint save types, retention) are that layer's functions, called here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kiln.core.event import Event
from kiln.core.time import Time, TimeUnit
from kiln.parallel.transforms.parallelize import ParallelizeOptions
from kiln.trainer.goodput import GoodputMonitor
from kiln.trainer.progress import parse_console_interval

__all__ = [
    "TrainerOptions",
    "DurationOptions",
    "MicrobatchOptions",
    "EvalOptions",
    "LogOptions",
    "CheckpointOptions",
    "LeverOptions",
    "DataOptions",
    "resolve_duration",
]


def _positive_int(name: str, value: Any, *, none: bool = False, extra: str = "") -> None:
    """The one check for an argument that must be an int >= 1 (bools are not ints here)."""
    if value is None and none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1{extra}")


def resolve_duration(value: Any) -> Time:
    """max_duration as a Time: ints are epochs; ``dur`` is not allowed (it is relative to itself)."""
    if isinstance(value, bool) or not isinstance(value, (int, str, Time)):
        raise ValueError(
            f"max_duration={value!r} must be an int (epochs), a time string like '10ep' or '500ba', or a kiln.Time"
        )
    time = Time.from_input(value)
    if time.unit == TimeUnit.DURATION:
        raise ValueError(
            f"max_duration={value!r} cannot be a fraction of itself; use ep, ba, sp, tok or a wall-clock time"
        )
    if time.value <= 0:
        raise ValueError(f"max_duration={value!r} must be positive")
    return time


def _interval(name: str, value: Any) -> Time | Callable:
    if callable(value) and not isinstance(value, Time):
        return value
    try:
        time = Time.from_input(value)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{name}={value!r} is not a time: {exc}") from None
    if time.unit not in (TimeUnit.EPOCH, TimeUnit.BATCH, TimeUnit.DURATION) or time.value <= 0:
        raise ValueError(
            f"{name}={value!r} must be a positive number of epochs ('1ep'), batches ('100ba') "
            "or a fraction of the run ('0.25dur')"
        )
    return time


@dataclass
class DurationOptions:
    """How long the run is and what an epoch holds."""

    max_duration: Time | None = None
    """When ``fit()`` ends (ints are epochs; stretched by ``scale_schedule_ratio``)."""
    scale_schedule_ratio: float = 1.0
    """Composer's: the run and its time-aware schedules stretch by this factor."""
    train_subset_num_batches: int | None = None
    """Train on only the first N batches of each epoch (None or -1: all of them)."""
    step_schedulers_every_batch: bool | None = None
    """Step torch schedulers per batch rather than per epoch (None: kiln's schedulers per batch, torch's per epoch)."""

    def __post_init__(self) -> None:
        ssr = self.scale_schedule_ratio
        if isinstance(ssr, bool) or not isinstance(ssr, (int, float)) or ssr <= 0:
            raise ValueError(f"scale_schedule_ratio={ssr!r} must be a positive number")
        self.scale_schedule_ratio = float(ssr)
        if self.max_duration is not None:
            duration = resolve_duration(self.max_duration)
            if ssr != 1.0:  # the run stretches with its schedules (Composer's scale_schedule_ratio)
                duration = Time(
                    max(1, int(duration.value * ssr)) if isinstance(duration.value, int) else duration.value * ssr,
                    duration.unit,
                )
            self.max_duration = duration
        subset = self.train_subset_num_batches
        if subset != -1:
            _positive_int("train_subset_num_batches", subset, none=True, extra=", or -1/None for the whole dataloader")
        self.train_subset_num_batches = None if subset == -1 else subset


@dataclass
class MicrobatchOptions:
    """How a batch is split into microbatches (the gradients of one step add up over them)."""

    grad_accum: int = 1
    """Split each batch into this many microbatches."""
    device_train_microbatch_size: int | str | None = None
    """Or: samples per microbatch, or ``"auto"`` (halve on out-of-memory and retry)."""
    microbatch: int | None = field(default=None, init=False)
    """The microbatch size in use (None: from ``grad_accum``)."""
    auto_microbatch: bool = field(default=False, init=False)
    splits_batches: bool = field(default=False, init=False)
    """Whether batches may be split at all (the loop skips splitting otherwise)."""

    def __post_init__(self) -> None:
        _positive_int("grad_accum", self.grad_accum)
        size = self.device_train_microbatch_size
        if size == "auto":
            self.auto_microbatch = True
        elif size is not None:
            _positive_int("device_train_microbatch_size", size, extra=", or 'auto'")
            if self.grad_accum != 1:
                raise ValueError(
                    f"grad_accum={self.grad_accum!r} and device_train_microbatch_size={size!r} both split "
                    "batches; set one of them"
                )
            assert isinstance(size, int)  # checked above
            self.microbatch = size
        self.splits_batches = self.auto_microbatch or self.microbatch is not None or self.grad_accum > 1

    def microbatch_size(self, batch_size: int) -> int:
        if self.microbatch is not None:
            return self.microbatch
        if self.grad_accum > 1:
            return -(-batch_size // self.grad_accum)  # ceil: grad_accum microbatches at most
        return batch_size

    def halve_microbatch(self, batch_size: int) -> None:
        current = self.microbatch or batch_size
        if current <= 1:
            raise torch.OutOfMemoryError(
                "out of memory with a microbatch of 1 sample; device_train_microbatch_size='auto' cannot go lower"
            )
        self.microbatch = current // 2

    def any_rank_oom(self, local_oom: bool) -> bool:
        """Whether any rank ran out of memory on this batch (one collective, only in 'auto' mode)."""
        import torch.distributed as dist

        from kiln.launch.context import context

        if not (dist.is_available() and dist.is_initialized()):
            return local_oom
        # on the device the backend syncs: NCCL refuses CPU tensors
        flag = torch.tensor([1.0 if local_oom else 0.0], device=context().device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


@dataclass
class EvalOptions:
    """When evaluation runs during ``fit()`` and how much of the eval data it reads."""

    eval_interval: Time | Callable = field(default_factory=lambda: Time(1, TimeUnit.EPOCH))
    """A Time (``"1ep"``, ``"100ba"``, ``"0.25dur"``), int epochs, or ``fn(state, event) -> bool``."""
    eval_subset_num_batches: int | None = None
    """Evaluate on the first N batches only (None: all)."""

    def __post_init__(self) -> None:
        self.eval_interval = _interval("eval_interval", self.eval_interval)
        _positive_int("eval_subset_num_batches", self.eval_subset_num_batches, none=True, extra=", or None")

    def eval_due(self, state: Any, event: Event) -> bool:
        interval = self.eval_interval
        if callable(interval) and not isinstance(interval, Time):
            return bool(interval(state, event))
        if interval.unit == TimeUnit.DURATION:
            interval = state.resolve(interval)
            if interval.value <= 0:
                return False
        ts = state.timestamp
        if interval.unit == TimeUnit.EPOCH:
            return event == Event.EPOCH_END and ts.epoch.value % interval.value == 0
        return event == Event.BATCH_END and ts.batch.value % interval.value == 0

    def evaluates_on(self, event: Event) -> bool:
        """Whether evaluation can ever be due at ``event`` (so the loop can skip asking per batch)."""
        interval = self.eval_interval
        if not isinstance(interval, Time) or interval.unit == TimeUnit.DURATION:
            return True
        return (interval.unit == TimeUnit.BATCH) == (event == Event.BATCH_END)


@dataclass
class LogOptions:
    """Where metrics go and how often."""

    loggers: Any = ()
    """A logger destination or a list of them (see :mod:`kiln.loggers`)."""
    log_interval: int | str | Time = "1ba"
    """Log train metrics every N batches (``"10ba"``)."""
    progress_bar: bool = True
    """Show progress on rank 0: a bar on a terminal, plain lines when stdout is not one."""
    console_interval: Time | str | float | None = "30s"
    """The most time between two progress lines when stdout is not a terminal (``"30s"``,
    ``"5m"``, ``"100ba"``; a line also comes at each tenth of the run); ``None``: no lines."""
    goodput: Any = True
    """Keep the run's goodput account (:class:`kiln.trainer.goodput.GoodputMonitor`): ``True``
    (the default), ``False`` (none), or a ``GoodputMonitor`` with its own settings. Made the
    monitor (or ``None``) here."""
    log_every: int = field(default=1, init=False)
    """``log_interval`` in batches."""

    def __post_init__(self) -> None:
        loggers = self.loggers
        self.loggers = [] if loggers is None else list(loggers) if isinstance(loggers, (list, tuple)) else [loggers]
        log = Time.from_input(self.log_interval, TimeUnit.BATCH)
        if log.unit != TimeUnit.BATCH or log.value < 1:
            raise ValueError(f"log_interval={self.log_interval!r} must be a positive number of batches, e.g. '10ba'")
        self.log_every = int(log.value)
        self.console_interval = parse_console_interval(self.console_interval)
        if self.goodput is True:
            self.goodput = GoodputMonitor()
        elif self.goodput is False or self.goodput is None:
            self.goodput = None
        elif not isinstance(self.goodput, GoodputMonitor):
            raise ValueError(
                f"goodput={self.goodput!r} must be True (the default account), False (none) or a "
                "kiln.trainer.goodput.GoodputMonitor"
            )


@dataclass
class CheckpointOptions:
    """Where and when checkpoints are written, and what is loaded at the start."""

    save_folder: Any = None
    """A folder for checkpoints (None: none are written on intervals)."""
    save_interval: Any = "1ep"
    """When to save (a Time, time string, int epochs or ``fn(state, event) -> bool``)."""
    save_num_checkpoints_to_keep: int = -1
    """Keep the N newest checkpoints (-1: all)."""
    save_type: str = "sharded"
    """The checkpoint format (see :mod:`kiln.checkpoint.formats`)."""
    save_best: Any = None
    """A metric (and ``"min"``/``"max"``) whose best checkpoint is linked as ``best``."""
    save_async: bool = False
    """Write checkpoints in the background."""
    load_path: Any = None
    """A checkpoint to load before training (``"last"``/``"best"`` inside ``save_folder`` too)."""
    autoresume: bool = False
    """Load ``save_folder``'s ``last`` when there is one (a restarted job continues)."""
    storage_options: Mapping[str, Any] | None = None
    """For URL save folders and load paths (``s3://...``): the fsspec filesystem's options
    (credentials, ``endpoint_url``); by default the standard environment variables."""

    def __post_init__(self) -> None:
        # The checkpoint layer's own rules. Imported here rather than at the top so that importing
        # the Trainer does not import the checkpoint code.
        from kiln.checkpoint.formats import check_save_type
        from kiln.checkpoint.layout import check_num_checkpoints_to_keep

        self.save_type = check_save_type(self.save_type)
        check_num_checkpoints_to_keep(self.save_num_checkpoints_to_keep, "save_num_checkpoints_to_keep")
        if self.autoresume and self.save_folder is None:
            raise ValueError("autoresume=True needs save_folder= (where to look for 'last')")


@dataclass
class LeverOptions:
    """The throughput levers the strategy applies to the model's blocks (see
    :class:`kiln.parallel.ParallelizeOptions`, which checks them)."""

    compile: bool | Mapping[str, Any] = False
    """``True`` or a dict of ``torch.compile`` arguments: each block's forward is compiled."""
    activation_checkpointing: str | Callable[[nn.Module], bool] | None = None
    """``"full"``, ``"selective"`` (keeps matmul outputs), ``"selective:N"`` (every Nth block) or ``fn(module) -> bool``."""

    float8: bool | Mapping[str, Any] | None = None
    """``True`` or a dict of torchao float8 settings: FP8 matmuls in the eligible Linear layers."""

    def __post_init__(self) -> None:
        self.parallelize_options()  # the checks live with the options the strategy reads

    def parallelize_options(self) -> ParallelizeOptions:
        return ParallelizeOptions(
            compile=self.compile, activation_checkpointing=self.activation_checkpointing, float8=self.float8
        )


@dataclass
class DataOptions:
    """How the training loader is built around the user's (see :func:`kiln.launch.streaming.resumable_train_loader`)."""

    stateful_dataloader: bool | None = None
    """``True``: a torch DataLoader becomes torchdata's ``StatefulDataLoader`` (its state resumes
    iterable data mid-epoch without replay); ``None``: only one over an iterable dataset with
    ``state_dict``/``load_state_dict`` and workers; ``False``: never."""

    def __post_init__(self) -> None:
        if not (self.stateful_dataloader is None or isinstance(self.stateful_dataloader, bool)):
            raise ValueError(
                f"stateful_dataloader={self.stateful_dataloader!r} must be True, False or None "
                "(None: only for an iterable dataset with state read by workers)"
            )


@dataclass
class TrainerOptions:
    """The Trainer's validated arguments, by group (``trainer.options.microbatching.grad_accum``)."""

    duration: DurationOptions = field(default_factory=DurationOptions)
    microbatching: MicrobatchOptions = field(default_factory=MicrobatchOptions)
    evaluation: EvalOptions = field(default_factory=EvalOptions)
    logging: LogOptions = field(default_factory=LogOptions)
    checkpointing: CheckpointOptions = field(default_factory=CheckpointOptions)
    levers: LeverOptions = field(default_factory=LeverOptions)
    data: DataOptions = field(default_factory=DataOptions)
