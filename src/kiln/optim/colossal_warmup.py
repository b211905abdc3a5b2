"""Colossal-AI's warmup and flat-start schedulers: a linear warmup and/or a flat stretch at
``base_lr``, then one of the plain schedules from `kiln.optim.colossal_plain`.

They share one wrapper, `_WarmupScheduler` (Colossal-AI's ``WarmupScheduler``,
``DelayerScheduler`` and ``WarmupDelayerScheduler`` in one class). The conventions - closed forms,
the warmup ramp, the post-warmup clock, holding after ``total_steps`` - are written down in
`kiln.optim.colossal`, which every name here is imported from.
"""

from collections.abc import Iterable, Sequence
from typing import Any

from torch.optim import Optimizer
from torch.optim import lr_scheduler as torch_sched
from torch.optim.lr_scheduler import LRScheduler

from kiln.optim.colossal_plain import (
    CosineAnnealingLR,
    MultiStepLR,
    PolynomialLR,
    _check_milestones,
    _check_steps,
    _ClosedForm,
)

__all__ = [
    "CosineAnnealingWarmupLR",
    "FlatAnnealingLR",
    "FlatAnnealingWarmupLR",
    "LinearWarmupLR",
    "MultiStepWarmupLR",
    "PolynomialWarmupLR",
]


def _flat_steps(pct_start: float, steps: int) -> int:
    """Steps held flat before annealing, Colossal-AI's ``int(steps * pct_start)``; >= 1 must remain."""
    if not 0.0 <= pct_start < 1.0 or steps - int(steps * pct_start) < 1:
        raise ValueError(f"pct_start must be in [0, 1) and leave at least one step to anneal over, got {pct_start!r}")
    return int(steps * pct_start)


class _WarmupScheduler(_ClosedForm, LRScheduler):
    """Linear warmup, then a flat stretch at ``base_lr``, then the wrapped ``after_scheduler``.

    This is Colossal-AI's ``WarmupScheduler`` / ``DelayerScheduler`` / ``WarmupDelayerScheduler``
    in one class. With ``W = warmup_steps``, ``D = delay_steps`` and ``R = ramp_steps`` (``W``
    unless given)::

        lr(step) = base_lr * (step + 1) / R                        step < W
                 = base_lr                                          W <= step < W + D
                 = after_scheduler's closed form at step - W - D    otherwise

    ``after_scheduler`` is only evaluated, never stepped on its own, and it is handed this
    scheduler's ``base_lrs`` so a changed or restored ``base_lrs`` reaches it (Colossal-AI copies
    them across at the hand-over for the same reason). Evaluating rather than stepping also avoids
    a drift Colossal-AI's own wrapper has on current torch (2.13 checked): torch's recursive cosine
    takes its first step from ``after.last_epoch == 0`` as a ratio against step -1, scaling the
    whole post-warmup curve by ``2 / (1 + cos(pi / T))``, up to a few percent on short schedules.

    Args:
        optimizer: Wrapped optimizer; ``after_scheduler`` must wrap the same one.
        total_steps: Steps in the whole schedule; ``after_scheduler`` covers the last
            ``total_steps - W - D`` of them.
        warmup_steps: Steps of linear warmup.
        after_scheduler: A `_ClosedForm` scheduler that takes over after warmup and the flat stretch.
        delay_steps: Steps held at ``base_lr`` between warmup and ``after_scheduler``.
        ramp_steps: Denominator of the warmup ramp; defaults to ``warmup_steps``.
        last_epoch: Index of the last step, as in torch; -1 starts the schedule.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        warmup_steps: int,
        after_scheduler: _ClosedForm,
        delay_steps: int = 0,
        ramp_steps: int | None = None,
        last_epoch: int = -1,
    ) -> None:
        # Invariants the public constructors have already established for the user.
        assert after_scheduler.total_steps == total_steps - warmup_steps - delay_steps
        assert getattr(after_scheduler, "optimizer", None) is optimizer
        self.total_steps = total_steps
        self.warmup_steps = warmup_steps
        self.delay_steps = delay_steps
        self.ramp_steps = warmup_steps if ramp_steps is None else ramp_steps
        self.after_scheduler = after_scheduler
        super().__init__(optimizer, last_epoch)

    def _closed_form(self, step: int, base_lrs: Sequence[float]) -> list[float]:
        if step < self.warmup_steps:
            return [base_lr * (step + 1) / self.ramp_steps for base_lr in base_lrs]
        if step < self.warmup_steps + self.delay_steps:
            return list(base_lrs)
        return self.after_scheduler._closed_form(step - self.warmup_steps - self.delay_steps, base_lrs)

    def state_dict(self) -> dict[str, Any]:
        # torch's default would pickle the after_scheduler object, optimizer and all; nest its
        # state_dict instead so checkpoints stay plain data (loadable with weights_only=True).
        state = super().state_dict()
        state["after_scheduler"] = self.after_scheduler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        after_state = state.pop("after_scheduler")
        self.after_scheduler.load_state_dict(after_state)
        super().load_state_dict(state)


class CosineAnnealingWarmupLR(_WarmupScheduler):
    """Linear warmup, then `CosineAnnealingLR` over the remaining steps.

    With ``W = warmup_steps``, ``T = total_steps - W`` and ``t = step - W``::

        lr = base_lr * (step + 1) / W                                  step < W
           = eta_min + (base_lr - eta_min) * (1 + cos(pi * t / T)) / 2  otherwise

    Args:
        optimizer: Wrapped optimizer; its current lr is ``base_lr``.
        total_steps: Steps in the whole schedule, warmup included.
        warmup_steps: Steps of linear warmup, ``0 <= warmup_steps < total_steps``.
        eta_min: Final learning rate.
        last_epoch: Index of the last step, as in torch; -1 starts the schedule.

    Examples:
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
        >>> sched = CosineAnnealingWarmupLR(opt, total_steps=10, warmup_steps=4)
        >>> opt.param_groups[0]["lr"]  # step 0 of 4 warmup steps
        0.25
    """

    def __init__(
        self, optimizer: Optimizer, total_steps: int, warmup_steps: int = 0, eta_min: float = 0.0, last_epoch: int = -1
    ) -> None:
        total, warmup = _check_steps(total_steps, warmup_steps)
        after = CosineAnnealingLR(optimizer, total - warmup, eta_min=eta_min)
        super().__init__(optimizer, total, warmup, after, last_epoch=last_epoch)


class FlatAnnealingLR(_WarmupScheduler):
    """``base_lr`` for the first ``pct_start`` of the steps, then cosine annealing to 0.

    With ``F = int(total_steps * pct_start)``, ``T = total_steps - F`` and ``t = step - F``::

        lr = base_lr                                  step < F
           = base_lr * (1 + cos(pi * t / T)) / 2      otherwise

    Args:
        optimizer: Wrapped optimizer; its current lr is ``base_lr``.
        total_steps: Steps in the whole schedule.
        pct_start: Fraction of ``total_steps`` held flat, in ``[0, 1)``.
        last_epoch: Index of the last step, as in torch; -1 starts the schedule.

    Examples:
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
        >>> sched = FlatAnnealingLR(opt, total_steps=10, pct_start=0.5)
        >>> sched.delay_steps  # steps 0-4 at lr=1.0, then 5 steps of cosine
        5
    """

    def __init__(self, optimizer: Optimizer, total_steps: int, pct_start: float = 0.72, last_epoch: int = -1) -> None:
        total, _ = _check_steps(total_steps)
        flat = _flat_steps(pct_start, total)
        self.pct_start = pct_start
        after = CosineAnnealingLR(optimizer, total - flat)
        super().__init__(optimizer, total, 0, after, delay_steps=flat, last_epoch=last_epoch)


class FlatAnnealingWarmupLR(_WarmupScheduler):
    """Linear warmup, then ``base_lr`` for ``pct_start`` of the rest, then cosine to ``eta_min``.

    With ``W = warmup_steps``, ``F = int((total_steps - W) * pct_start)``,
    ``T = total_steps - W - F`` and ``t = step - W - F``::

        lr = base_lr * (step + 1) / W                                  step < W
           = base_lr                                                    W <= step < W + F
           = eta_min + (base_lr - eta_min) * (1 + cos(pi * t / T)) / 2  otherwise

    Args:
        optimizer: Wrapped optimizer; its current lr is ``base_lr``.
        total_steps: Steps in the whole schedule, warmup included.
        warmup_steps: Steps of linear warmup, ``0 <= warmup_steps < total_steps``.
        pct_start: Fraction of the post-warmup steps held flat, in ``[0, 1)``.
        eta_min: Final learning rate.
        last_epoch: Index of the last step, as in torch; -1 starts the schedule.

    Examples:
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
        >>> sched = FlatAnnealingWarmupLR(opt, total_steps=12, warmup_steps=2, pct_start=0.5)
        >>> (sched.warmup_steps, sched.delay_steps, sched.after_scheduler.total_steps)
        (2, 5, 5)
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        pct_start: float = 0.72,
        eta_min: float = 0,
        last_epoch: int = -1,
    ) -> None:
        total, warmup = _check_steps(total_steps, warmup_steps)
        flat = _flat_steps(pct_start, total - warmup)
        self.pct_start = pct_start
        after = CosineAnnealingLR(optimizer, total - warmup - flat, eta_min=eta_min)
        super().__init__(optimizer, total, warmup, after, delay_steps=flat, last_epoch=last_epoch)


class _LinearDecayLR(_ClosedForm, torch_sched.LinearLR):
    """``lr = base_lr * (total_steps - step) / total_steps``: torch's LinearLR from 1x to 0x."""

    def __init__(self, optimizer: Optimizer, total_steps: int) -> None:
        self.total_steps = total_steps
        super().__init__(optimizer, start_factor=1.0, end_factor=0.0, total_iters=total_steps)

    def _closed_form(self, step: int, base_lrs: Sequence[float]) -> list[float]:
        return [base_lr * (self.total_steps - step) / self.total_steps for base_lr in base_lrs]


class LinearWarmupLR(_WarmupScheduler):
    """Linear warmup to ``base_lr``, then linear decay to 0 at ``total_steps``.

    Unlike the other warmup schedules the ramp divides by ``warmup_steps + 1``, exactly as
    Colossal-AI's ``LinearWarmupLR`` does; the lr then peaks once, at ``step == warmup_steps``,
    instead of sitting at ``base_lr`` for two steps. With ``W = warmup_steps``::

        lr = base_lr * (step + 1) / (W + 1)                      step < W
           = base_lr * (total_steps - step) / (total_steps - W)  otherwise

    Args:
        optimizer: Wrapped optimizer; its current lr is ``base_lr``.
        total_steps: Steps in the whole schedule; ``lr == 0`` at ``step == total_steps``.
        warmup_steps: Steps of linear warmup, ``0 <= warmup_steps < total_steps``.
        last_epoch: Index of the last step, as in torch; -1 starts the schedule.

    Examples:
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
        >>> sched = LinearWarmupLR(opt, total_steps=10, warmup_steps=3)
        >>> opt.param_groups[0]["lr"]  # (0 + 1) / (3 + 1)
        0.25
    """

    def __init__(self, optimizer: Optimizer, total_steps: int, warmup_steps: int = 0, last_epoch: int = -1) -> None:
        total, warmup = _check_steps(total_steps, warmup_steps)
        after = _LinearDecayLR(optimizer, total - warmup)
        super().__init__(optimizer, total, warmup, after, ramp_steps=warmup + 1, last_epoch=last_epoch)


class MultiStepWarmupLR(_WarmupScheduler):
    """Linear warmup, then `MultiStepLR` with milestones counted from step 0 of the whole run.

    With ``W = warmup_steps``, ``n`` counting the milestones ``m`` with ``W <= m <= step``::

        lr = base_lr * (step + 1) / W     step < W
           = base_lr * gamma ** n          otherwise

    Milestones inside the warmup are ignored, as in Colossal-AI.

    Args:
        optimizer: Wrapped optimizer; its current lr is ``base_lr``.
        total_steps: Steps in the whole schedule, warmup included.
        warmup_steps: Steps of linear warmup, ``0 <= warmup_steps < total_steps``.
        milestones: Strictly increasing step indices at which the lr decays.
        gamma: Factor applied at each milestone, > 0.
        last_epoch: Index of the last step, as in torch; -1 starts the schedule.

    Examples:
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
        >>> sched = MultiStepWarmupLR(opt, total_steps=10, warmup_steps=2, milestones=[5])
        >>> sched.after_scheduler.milestones  # shifted onto the post-warmup clock
        Counter({3: 1})
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        milestones: Iterable[int] | None = None,
        gamma: float = 0.1,
        last_epoch: int = -1,
    ) -> None:
        total, warmup = _check_steps(total_steps, warmup_steps)
        self.milestones = _check_milestones(milestones)
        shifted = [m - warmup for m in self.milestones if m >= warmup]
        after = MultiStepLR(optimizer, total - warmup, milestones=shifted, gamma=gamma)
        super().__init__(optimizer, total, warmup, after, last_epoch=last_epoch)


class PolynomialWarmupLR(_WarmupScheduler):
    """Linear warmup, then `PolynomialLR` over the remaining steps.

    With ``W = warmup_steps``, ``T = total_steps - W`` and ``t = step - W``::

        lr = base_lr * (step + 1) / W                                 step < W
           = (base_lr - end_lr) * (1 - t / T) ** power + end_lr        otherwise

    Args:
        optimizer: Wrapped optimizer; its current lr is ``base_lr``.
        total_steps: Steps in the whole schedule, warmup included.
        warmup_steps: Steps of linear warmup, ``0 <= warmup_steps < total_steps``.
        end_lr: Final learning rate, >= 0.
        power: Exponent of the decay, > 0; 1.0 is linear.
        last_epoch: Index of the last step, as in torch; -1 starts the schedule.

    Examples:
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
        >>> sched = PolynomialWarmupLR(opt, total_steps=10, warmup_steps=2)
        >>> opt.param_groups[0]["lr"]  # step 0 of 2 warmup steps
        0.5
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        end_lr: float = 0.0001,
        power: float = 1.0,
        last_epoch: int = -1,
    ) -> None:
        total, warmup = _check_steps(total_steps, warmup_steps)
        after = PolynomialLR(optimizer, total - warmup, end_lr=end_lr, power=power)
        super().__init__(optimizer, total, warmup, after, last_epoch=last_epoch)
