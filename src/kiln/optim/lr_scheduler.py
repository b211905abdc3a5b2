"""Run a time-aware kiln scheduler as a torch ``LRScheduler``; scale torch schedulers by a ratio."""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import (
    CosineAnnealingLR,
    CosineAnnealingWarmRestarts,
    ExponentialLR,
    LRScheduler,
    MultiStepLR,
    StepLR,
)

__all__ = ["ComposerLRScheduler", "compile_composer_scheduler", "scale_torch_scheduler"]

# The schedule and the state are live objects rebuilt from the run's config, not checkpoint data.
_NOT_SAVED = frozenset({"optimizer", "_schedule", "_state", "ssr"})


class ComposerLRScheduler(LRScheduler):
    """A torch ``LRScheduler`` whose learning rate is ``base_lr * schedule(state, ssr)``.

    ``step()`` reads ``state.timestamp`` as it is at that moment, so the loop advances the timestamp
    first and then steps this once per batch; the schedule itself is stateless, which makes resume
    exact. ``state_dict()`` leaves out the schedule callable and the state, so it is plain data.

    Args:
        optimizer: the optimizer whose param groups' ``lr`` is set.
        schedule: ``schedule(state, ssr) -> float``, e.g. a :class:`kiln.optim.ComposerScheduler`.
        state: anything with ``timestamp`` and ``max_duration`` (normally ``kiln.State``).
        ssr: the scale-schedule ratio passed to ``schedule``.
        last_epoch: as in torch; ``-1`` for a fresh run.

    Examples:
        >>> import torch, types
        >>> from kiln.core.time import Time, Timestamp
        >>> from kiln.optim import LinearScheduler
        >>> state = types.SimpleNamespace(timestamp=Timestamp(), max_duration=Time.from_timestring("10ba"))
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> sched = ComposerLRScheduler(opt, LinearScheduler(), state)
        >>> state.timestamp.advance_batch(samples=4); opt.step(); sched.step()
        >>> round(opt.param_groups[0]["lr"], 6)
        0.09
    """

    def __init__(
        self, optimizer: Optimizer, schedule: Callable[..., float], state: Any, ssr: float = 1.0, last_epoch: int = -1
    ) -> None:
        if not callable(schedule):
            raise TypeError(f"schedule must be callable as schedule(state, ssr), got {schedule!r}")
        if ssr <= 0:
            raise ValueError(f"ssr (scale_schedule_ratio) must be > 0, got {ssr}")
        if not _takes_ssr(schedule):  # Composer's one-argument form f(state) -> float
            if ssr != 1.0:
                raise ValueError(
                    f"scheduler {schedule!r} takes only (state), so it cannot follow "
                    f"scale_schedule_ratio={ssr:g}; give it a second argument, f(state, ssr), and "
                    "stretch its times by ssr, or use a kiln.optim scheduler"
                )
            schedule = _StateOnly(schedule)
        # Set before super().__init__, which already calls get_lr() once.
        self._schedule = schedule
        self._state = state
        self.ssr = ssr
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[Any]:
        multiplier = self._schedule(self._state, self.ssr)
        return [base_lr * multiplier for base_lr in self.base_lrs]

    def state_dict(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if key not in _NOT_SAVED}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.__dict__.update({key: value for key, value in state_dict.items() if key not in _NOT_SAVED})


class _StateOnly:
    """A one-argument schedule ``f(state)`` called as ``f(state, ssr)`` (only ever with ssr 1)."""

    def __init__(self, schedule: Callable[[Any], float]) -> None:
        self.schedule = schedule

    def __call__(self, state: Any, ssr: float = 1.0) -> float:
        return self.schedule(state)


def _takes_ssr(schedule: Callable[..., float]) -> bool:
    """Whether ``schedule`` can be called as ``schedule(state, ssr)`` (Composer checks the same)."""
    try:
        params = inspect.signature(schedule).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): assume the full form
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


def scale_torch_scheduler(scheduler: LRScheduler, ssr: float) -> None:
    """Stretch a torch scheduler's schedule by ``ssr`` in place, as Composer's Trainer does.

    ``StepLR.step_size``, ``MultiStepLR.milestones``, ``CosineAnnealingLR.T_max`` and
    ``CosineAnnealingWarmRestarts.T_0`` are multiplied by ``ssr`` and rounded down;
    ``ExponentialLR.gamma`` becomes ``gamma ** (1 / ssr)``. Any other scheduler cannot be scaled and
    raises, naming what to use instead.

    Examples:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
        >>> scale_torch_scheduler(sched, 0.5); sched.step_size
        5
    """
    if ssr <= 0:
        raise ValueError(f"scale_schedule_ratio must be > 0, got {ssr}")
    if ssr == 1.0:
        return
    name = type(scheduler).__name__
    if type(scheduler).__module__.startswith("kiln.optim.colossal"):
        raise ValueError(
            f"scale_schedule_ratio={ssr:g} cannot scale {name}: a Colossal-AI scheduler counts steps up "
            "to its total_steps; build it with total_steps (and warmup_steps) already scaled, or use a "
            "kiln.optim time-aware scheduler"
        )

    def scaled(value: int, attribute: str) -> int:
        result = int(value * ssr)
        if result < 1:
            raise ValueError(
                f"scale_schedule_ratio={ssr:g} makes {name}.{attribute}={value} round down to {result}; "
                f"the schedule needs {attribute} >= 1 after scaling, so use a larger ratio or {attribute}"
            )
        return result

    if isinstance(scheduler, StepLR):
        scheduler.step_size = scaled(scheduler.step_size, "step_size")
    elif isinstance(scheduler, MultiStepLR):
        scheduler.milestones = Counter({int(m * ssr): n for m, n in scheduler.milestones.items()})
    elif isinstance(scheduler, CosineAnnealingLR):
        scheduler.T_max = scaled(scheduler.T_max, "T_max")
    elif isinstance(scheduler, CosineAnnealingWarmRestarts):
        # T_i is the running cycle's length, which starts as T_0: scale both (Composer scales T_0 only).
        scheduler.T_0 = scaled(scheduler.T_0, "T_0")
        scheduler.T_i = scaled(scheduler.T_i, "T_i")
    elif isinstance(scheduler, ExponentialLR):
        scheduler.gamma = scheduler.gamma ** (1.0 / ssr)
    elif isinstance(scheduler, ComposerLRScheduler):
        if scheduler.ssr not in (1.0, ssr):
            raise ValueError(
                f"scale_schedule_ratio={ssr:g}, but this compiled scheduler was built with ssr="
                f"{scheduler.ssr:g}; pass the scheduler itself (not compiled) and let the Trainer "
                "scale it"
            )
        if isinstance(scheduler._schedule, _StateOnly):
            raise ValueError(
                f"scheduler {scheduler._schedule.schedule!r} takes only (state), so it cannot follow "
                f"scale_schedule_ratio={ssr:g}; give it a second argument, f(state, ssr)"
            )
        scheduler.ssr = ssr
    else:
        raise ValueError(
            f"scale_schedule_ratio={ssr:g} cannot scale {name}: only StepLR, MultiStepLR, ExponentialLR, "
            "CosineAnnealingLR and CosineAnnealingWarmRestarts can be scaled (as in Composer); write the "
            "schedule as a kiln.optim scheduler or a function f(state, ssr) -> float instead"
        )


def compile_composer_scheduler(
    scheduler: Callable[..., float], state: Any, optimizer: Optimizer | None = None, ssr: float = 1.0
) -> ComposerLRScheduler:
    """Wrap a time-aware ``scheduler`` around ``optimizer`` (default: the state's only optimizer).

    Examples:
        >>> # trainer side: lr_sched = compile_composer_scheduler(CosineAnnealingScheduler(), state, opt)
        >>> # every batch: state.timestamp.advance_batch(n); lr_sched.step()
    """
    if optimizer is None:
        optimizers = getattr(state, "optimizers", None)
        if isinstance(optimizers, Optimizer):
            optimizer = optimizers
        elif optimizers is not None and len(optimizers) == 1:
            optimizer = optimizers[0]
        else:
            raise ValueError(
                f"compile_composer_scheduler needs one optimizer; state.optimizers is {optimizers!r}, "
                "so pass optimizer= explicitly"
            )
    return ComposerLRScheduler(optimizer, scheduler, state, ssr=ssr)
