"""Run a time-aware kiln scheduler as a torch ``LRScheduler``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["ComposerLRScheduler", "compile_composer_scheduler"]

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

    Example:
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

    def __init__(self, optimizer: Optimizer, schedule: Callable[..., float], state: Any, ssr: float = 1.0,
                 last_epoch: int = -1) -> None:
        if not callable(schedule):
            raise TypeError(f"schedule must be callable as schedule(state, ssr), got {schedule!r}")
        if ssr <= 0:
            raise ValueError(f"ssr (scale_schedule_ratio) must be > 0, got {ssr}")
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


def compile_composer_scheduler(scheduler: Callable[..., float], state: Any, optimizer: Optimizer | None = None,
                               ssr: float = 1.0) -> ComposerLRScheduler:
    """Wrap a time-aware ``scheduler`` around ``optimizer`` (default: the state's only optimizer).

    Example:
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
            raise ValueError(f"compile_composer_scheduler needs one optimizer; state.optimizers is {optimizers!r}, "
                             "so pass optimizer= explicitly")
    return ComposerLRScheduler(optimizer, scheduler, state, ssr=ssr)
