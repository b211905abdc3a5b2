"""Validation of the Trainer's arguments, and the small decisions the loop asks of them
(is evaluation due, what microbatch size, how often to log)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kiln.core.event import Event
from kiln.core.time import Time, TimeUnit

__all__ = ["TrainerOptions", "resolve_duration"]


def resolve_duration(value: Any) -> Time:
    """max_duration as a Time: ints are epochs; ``dur`` is not allowed (it is relative to itself)."""
    if isinstance(value, bool) or not isinstance(value, (int, str, Time)):
        raise ValueError(f"max_duration={value!r} must be an int (epochs), a time string like '10ep' or '500ba', "
                         "or a kiln.Time")
    time = Time.from_input(value)
    if time.unit == TimeUnit.DURATION:
        raise ValueError(f"max_duration={value!r} cannot be a fraction of itself; use ep, ba, sp, tok or a wall-clock time")
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
        raise ValueError(f"{name}={value!r} must be a positive number of epochs ('1ep'), batches ('100ba') "
                         "or a fraction of the run ('0.25dur')")
    return time


@dataclass
class TrainerOptions:
    """The Trainer's arguments after validation."""

    max_duration: Time | None = None
    grad_accum: int = 1
    microbatch: int | None = None
    auto_microbatch: bool = False
    eval_interval: Time | Callable = field(default_factory=lambda: Time(1, TimeUnit.EPOCH))
    eval_subset_num_batches: int | None = None
    train_subset_num_batches: int | None = None
    log_every: int = 1
    save_type: str = "sharded"
    loggers: list = field(default_factory=list)
    scale_schedule_ratio: float = 1.0
    step_schedulers_every_batch: bool = False
    splits_batches: bool = False  # whether batches may be split into microbatches at all

    @classmethod
    def validate(cls, args: dict[str, Any]) -> TrainerOptions:
        opts = cls()
        ssr = args["scale_schedule_ratio"]
        if not isinstance(ssr, (int, float)) or ssr <= 0:
            raise ValueError(f"scale_schedule_ratio={ssr!r} must be a positive number")
        opts.scale_schedule_ratio = float(ssr)
        if args["max_duration"] is not None:
            duration = resolve_duration(args["max_duration"])
            if ssr != 1.0:  # the run stretches with its schedules (Composer's scale_schedule_ratio)
                duration = Time(max(1, int(duration.value * ssr)) if isinstance(duration.value, int)
                                else duration.value * ssr, duration.unit)
            opts.max_duration = duration
        grad_accum = args["grad_accum"]
        if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
            raise ValueError(f"grad_accum={grad_accum!r} must be an integer >= 1")
        opts.grad_accum = grad_accum
        mb = args["device_train_microbatch_size"]
        if mb == "auto":
            opts.auto_microbatch = True
        elif mb is not None:
            if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
                raise ValueError(f"device_train_microbatch_size={mb!r} must be a positive int or 'auto'")
            if grad_accum != 1:
                raise ValueError("set either grad_accum or device_train_microbatch_size, not both")
            opts.microbatch = mb
        opts.splits_batches = opts.auto_microbatch or opts.microbatch is not None or grad_accum > 1
        opts.eval_interval = _interval("eval_interval", args["eval_interval"])
        subset = args["eval_subset_num_batches"]
        if subset is not None and (not isinstance(subset, int) or subset < 1):
            raise ValueError(f"eval_subset_num_batches={subset!r} must be a positive int or None")
        opts.eval_subset_num_batches = subset
        train_subset = args["train_subset_num_batches"]
        if train_subset is not None and train_subset != -1 and (isinstance(train_subset, bool) or
                                                                not isinstance(train_subset, int) or train_subset < 1):
            raise ValueError(f"train_subset_num_batches={train_subset!r} must be a positive int, or -1/None for "
                             "the whole dataloader")
        opts.train_subset_num_batches = None if train_subset == -1 else train_subset
        log = Time.from_input(args["log_interval"], TimeUnit.BATCH)
        if log.unit != TimeUnit.BATCH or log.value < 1:
            raise ValueError(f"log_interval={args['log_interval']!r} must be a positive number of batches, e.g. '10ba'")
        opts.log_every = int(log.value)
        # Checked here, before training, by the checkpoint layer's own rule. Imported here rather
        # than at the top so that importing the Trainer does not import the checkpoint code.
        from kiln.checkpoint.formats import check_save_type

        opts.save_type = check_save_type(args["save_type"])
        keep = args["save_num_checkpoints_to_keep"]
        if not isinstance(keep, int) or keep == 0 or keep < -1:
            raise ValueError(f"save_num_checkpoints_to_keep={keep!r} must be -1 (keep all) or a positive int")
        loggers = args["loggers"]
        opts.loggers = [] if loggers is None else list(loggers) if isinstance(loggers, (list, tuple)) else [loggers]
        every = args["step_schedulers_every_batch"]
        opts.step_schedulers_every_batch = bool(every)
        return opts

    # -- decisions the loop asks for -----------------------------------------------------------
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

    def microbatch_size(self, batch_size: int) -> int:
        if self.microbatch is not None:
            return self.microbatch
        if self.grad_accum > 1:
            return -(-batch_size // self.grad_accum)  # ceil: grad_accum microbatches at most
        return batch_size

    def halve_microbatch(self, batch_size: int) -> None:
        current = self.microbatch or batch_size
        if current <= 1:
            raise torch.OutOfMemoryError("out of memory with a microbatch of 1 sample; "
                                         "device_train_microbatch_size='auto' cannot go lower")
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
