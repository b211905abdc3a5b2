"""Colossal-AI's plain step-counted schedulers, and the closed-form base every one of them shares.

``CosineAnnealingLR``, ``MultiStepLR``, ``OneCycleLR``, ``PolynomialLR`` and ``ExponentialLR``;
the warmup forms in `kiln.optim.colossal_warmup` build on them. The conventions both follow are
written down in `kiln.optim.colossal`, the module users import all of them from.
"""

import math
import operator
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

from torch import Tensor
from torch.optim import Optimizer
from torch.optim import lr_scheduler as torch_sched

__all__ = ["CosineAnnealingLR", "ExponentialLR", "MultiStepLR", "OneCycleLR", "PolynomialLR"]


def _check_int(name: str, value: Any, minimum: int, expected: str) -> int:
    """Return ``value`` as an int, raising ValueError naming ``name`` when it is not one >= minimum."""
    # operator.index accepts numpy/torch integers but refuses floats; bools are ints to Python
    # but never a meaningful step count, so they are refused by hand.
    try:
        as_int = operator.index(value)
    except TypeError:
        as_int = None
    if as_int is None or isinstance(value, bool) or as_int < minimum:
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return as_int


def _check_steps(total_steps: Any, warmup_steps: Any = 0) -> tuple[int, int]:
    """Validate the step counts every Colossal-AI scheduler takes; return them as ints."""
    total = _check_int("total_steps", total_steps, 1, "an integer >= 1 (the number of optimizer steps)")
    warmup = _check_int("warmup_steps", warmup_steps, 0, f"an integer with 0 <= warmup_steps < total_steps={total}")
    if warmup >= total:
        raise ValueError(
            f"warmup_steps must be an integer with 0 <= warmup_steps < total_steps={total}, "
            f"got {warmup_steps!r}; leave at least one step after warmup"
        )
    return total, warmup


def _check_positive(name: str, value: float, *, allow_zero: bool = False) -> float:
    """Raise ValueError naming ``name`` unless ``value`` is > 0 (or >= 0 with allow_zero)."""
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return value


def _check_milestones(milestones: Iterable[int] | None) -> list[int]:
    """Return ``milestones`` as a list of ints, raising ValueError unless strictly increasing and >= 0."""
    expected = "a list of strictly increasing step indices >= 0, such as [30, 80]"
    try:
        checked = [_check_int("milestones", m, 0, expected) for m in milestones]  # type: ignore[union-attr]  # None raises TypeError: caught
    except (TypeError, ValueError):  # TypeError: None or not iterable
        raise ValueError(f"milestones must be {expected}, got {milestones!r}") from None
    if any(a >= b for a, b in zip(checked, checked[1:])):
        raise ValueError(f"milestones must be {expected}, got {milestones!r}")
    return checked


class _ClosedForm:
    """Mixin placed before a torch scheduler class so its lr comes from a closed form.

    Subclasses set ``total_steps`` before calling the torch ``__init__`` (which steps once) and
    implement ``_closed_form(step, base_lrs)`` for ``0 <= step <= total_steps``. Past
    ``total_steps`` the schedule holds its final value: a loop that calls ``scheduler.step()`` after
    its last optimizer step must not see the lr wrap around (torch's cosine) or go negative
    (Colossal-AI's linear decay).
    """

    total_steps: int
    last_epoch: int
    base_lrs: list[Any]

    if TYPE_CHECKING:  # from the torch scheduler class this is mixed into

        def state_dict(self) -> dict[str, Any]: ...
        def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    def _closed_form(self, step: int, base_lrs: Sequence[float]) -> list[float]:
        raise NotImplementedError

    # torch's signature: a scheduler's lrs may be tensors; these are floats.
    def get_lr(self) -> list[float | Tensor]:
        return cast("list[float | Tensor]", self._closed_form(min(self.last_epoch, self.total_steps), self.base_lrs))

    # torch calls this when step(epoch) is given; the closed form is the same answer.
    def _get_closed_form_lr(self) -> list[float | Tensor]:
        return self.get_lr()


class CosineAnnealingLR(_ClosedForm, torch_sched.CosineAnnealingLR):
    """Cosine annealing from ``base_lr`` to ``eta_min`` over ``total_steps`` steps.

    ``lr = eta_min + (base_lr - eta_min) * (1 + cos(pi * step / total_steps)) / 2``.

    Args:
        optimizer: Wrapped optimizer; its current lr is ``base_lr``.
        total_steps: Steps to anneal over; ``lr == eta_min`` at ``step == total_steps``.
        eta_min: Final learning rate.
        last_epoch: Index of the last step, as in torch; -1 starts the schedule.

    Examples:
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
        >>> sched = CosineAnnealingLR(opt, total_steps=4, eta_min=0.1)
        >>> for _ in range(2):
        ...     opt.step()
        ...     sched.step()
        >>> opt.param_groups[0]["lr"]  # halfway: (1.0 + 0.1) / 2
        0.55
    """

    def __init__(self, optimizer: Optimizer, total_steps: int, eta_min: float = 0, last_epoch: int = -1) -> None:
        self.total_steps, _ = _check_steps(total_steps)
        _check_positive("eta_min", eta_min, allow_zero=True)
        super().__init__(optimizer, T_max=self.total_steps, eta_min=eta_min, last_epoch=last_epoch)

    def _closed_form(self, step: int, base_lrs: Sequence[float]) -> list[float]:
        cosine = (1 + math.cos(math.pi * step / self.T_max)) / 2
        return [self.eta_min + (base_lr - self.eta_min) * cosine for base_lr in base_lrs]


class MultiStepLR(_ClosedForm, torch_sched.MultiStepLR):
    """Multiply the lr by ``gamma`` at each milestone step.

    ``lr = base_lr * gamma ** n`` where ``n`` counts the milestones ``m <= step``.

    Args:
        optimizer: Wrapped optimizer; its current lr is ``base_lr``.
        total_steps: Steps in the whole schedule.
        milestones: Strictly increasing step indices at which the lr decays.
        gamma: Factor applied at each milestone, > 0.
        last_epoch: Index of the last step, as in torch; -1 starts the schedule.

    Examples:
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
        >>> sched = MultiStepLR(opt, total_steps=10, milestones=[1, 3], gamma=0.5)
        >>> for _ in range(3):
        ...     opt.step()
        ...     sched.step()
        >>> opt.param_groups[0]["lr"]  # step 3: both milestones passed
        0.25
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        milestones: Iterable[int] | None = None,
        gamma: float = 0.1,
        last_epoch: int = -1,
    ) -> None:
        self.total_steps, _ = _check_steps(total_steps)
        checked = _check_milestones(milestones)
        _check_positive("gamma", gamma)
        super().__init__(optimizer, milestones=checked, gamma=gamma, last_epoch=last_epoch)

    def _closed_form(self, step: int, base_lrs: Sequence[float]) -> list[float]:
        # self.milestones is torch's Counter; sorting it each call keeps a loaded one authoritative.
        passed = bisect_right(sorted(self.milestones.elements()), step)
        return [base_lr * self.gamma**passed for base_lr in base_lrs]


class OneCycleLR(torch_sched.OneCycleLR):
    """torch's 1cycle policy with ``max_lr`` taken from the optimizer's current lr.

    With ``lo = max_lr / div_factor``, ``end = lo / final_div_factor``, ``P = pct_start *
    total_steps - 1`` and ``anneal(a, b, x)`` = ``b + (a - b) * (1 + cos(pi * x)) / 2`` (``'cos'``)
    or ``a + (b - a) * x`` (``'linear'``)::

        lr = anneal(lo, max_lr, step / P)                                  step <= P
           = anneal(max_lr, end, (step - P) / (total_steps - 1 - P))       otherwise

    so ``lr == end`` at ``step == total_steps - 1``, held from then on (torch raises instead).
    With ``cycle_momentum`` the momentum (or Adam's beta1) runs the same curves from
    ``max_momentum`` down to ``base_momentum`` and back.

    Args:
        optimizer: Wrapped optimizer; its current lr becomes ``max_lr``.
        total_steps: Steps in the cycle.
        pct_start: Fraction of the steps spent rising to ``max_lr``, in ``[0, 1]``.
        anneal_strategy: ``'cos'`` or ``'linear'``.
        cycle_momentum: Whether to cycle momentum inversely to the lr.
        base_momentum: Momentum at the lr peak.
        max_momentum: Momentum at the start and end.
        div_factor: ``max_lr / div_factor`` is the starting lr, > 0.
        final_div_factor: The starting lr divided by this is the final lr, > 0.
        last_epoch: Index of the last step, as in torch; -1 starts the schedule.

    Examples:
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0, momentum=0.9)
        >>> sched = OneCycleLR(opt, total_steps=10, div_factor=4.0)
        >>> opt.param_groups[0]["lr"]  # max_lr / div_factor
        0.25
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        pct_start: float = 0.3,
        anneal_strategy: Literal["cos", "linear"] = "cos",
        cycle_momentum: bool = True,
        base_momentum: float = 0.85,
        max_momentum: float = 0.95,
        div_factor: float = 25.0,
        final_div_factor: float = 10000.0,
        last_epoch: int = -1,
    ) -> None:
        total, _ = _check_steps(total_steps)
        if not 0.0 <= pct_start <= 1.0:
            raise ValueError(f"pct_start must be in [0, 1], got {pct_start!r}")
        if pct_start * total == 1:
            # torch's first phase would then run from step 0 to step 0 and divide by zero.
            raise ValueError(
                f"pct_start * total_steps must not be exactly 1 (a one-step rise), got pct_start={pct_start!r} "
                f"with total_steps={total}; use a pct_start giving no rise or a rise of 2+ steps"
            )
        _check_positive("div_factor", div_factor)
        _check_positive("final_div_factor", final_div_factor)
        max_lrs = [group["lr"] for group in optimizer.param_groups]
        super().__init__(
            optimizer,
            max_lrs,
            total_steps=total,
            pct_start=float(pct_start),  # torch insists on a float; Colossal-AI configs may say 0 or 1
            anneal_strategy=anneal_strategy,
            cycle_momentum=cycle_momentum,
            base_momentum=base_momentum,
            max_momentum=max_momentum,
            div_factor=div_factor,
            final_div_factor=final_div_factor,
            last_epoch=last_epoch,
        )

    def get_lr(self) -> list[float | Tensor]:
        if self.last_epoch < self.total_steps:
            return super().get_lr()
        # Hold the final lr (and momentum) rather than let torch raise past total_steps or
        # extrapolate the cosine at step == total_steps.
        stepped, self.last_epoch = self.last_epoch, self.total_steps - 1
        try:
            return super().get_lr()
        finally:
            self.last_epoch = stepped


class PolynomialLR(_ClosedForm, torch_sched.PolynomialLR):
    """Polynomial decay from ``base_lr`` to ``end_lr`` over ``total_steps`` steps.

    ``lr = (base_lr - end_lr) * (1 - step / total_steps) ** power + end_lr``; torch's
    PolynomialLR is the ``end_lr == 0`` case.

    Args:
        optimizer: Wrapped optimizer; its current lr is ``base_lr``.
        total_steps: Steps to decay over; ``lr == end_lr`` at ``step == total_steps``.
        end_lr: Final learning rate, >= 0.
        power: Exponent of the decay, > 0; 1.0 is linear.
        last_epoch: Index of the last step, as in torch; -1 starts the schedule.

    Examples:
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
        >>> sched = PolynomialLR(opt, total_steps=4, end_lr=0.0, power=2.0)
        >>> for _ in range(2):
        ...     opt.step()
        ...     sched.step()
        >>> opt.param_groups[0]["lr"]  # (1 - 2/4) ** 2
        0.25
    """

    def __init__(
        self, optimizer: Optimizer, total_steps: int, end_lr: float = 0.0001, power: float = 1.0, last_epoch: int = -1
    ) -> None:
        self.total_steps, _ = _check_steps(total_steps)
        self.end_lr = _check_positive("end_lr", end_lr, allow_zero=True)
        _check_positive("power", power)
        super().__init__(optimizer, total_iters=self.total_steps, power=power, last_epoch=last_epoch)

    def _closed_form(self, step: int, base_lrs: Sequence[float]) -> list[float]:
        decay = (1 - step / self.total_iters) ** self.power
        return [(base_lr - self.end_lr) * decay + self.end_lr for base_lr in base_lrs]


class ExponentialLR(_ClosedForm, torch_sched.ExponentialLR):
    """Multiply the lr by ``gamma`` every step: ``lr = base_lr * gamma ** step``.

    Colossal-AI ignores ``total_steps`` here; kiln uses it only to hold the lr after the last step.

    Args:
        optimizer: Wrapped optimizer; its current lr is ``base_lr``.
        total_steps: Steps in the whole schedule.
        gamma: Factor applied each step, > 0.
        last_epoch: Index of the last step, as in torch; -1 starts the schedule.

    Examples:
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
        >>> sched = ExponentialLR(opt, total_steps=10, gamma=0.5)
        >>> opt.step()
        >>> sched.step()
        >>> opt.param_groups[0]["lr"]
        0.5
    """

    def __init__(self, optimizer: Optimizer, total_steps: int, gamma: float = 1.0, last_epoch: int = -1) -> None:
        self.total_steps, _ = _check_steps(total_steps)
        _check_positive("gamma", gamma)
        super().__init__(optimizer, gamma=gamma, last_epoch=last_epoch)

    def _closed_form(self, step: int, base_lrs: Sequence[float]) -> list[float]:
        return [base_lr * self.gamma**step for base_lr in base_lrs]
