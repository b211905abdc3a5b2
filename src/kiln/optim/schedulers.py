"""Composer-style time-aware learning-rate schedulers.

A scheduler is a callable ``scheduler(state, ssr=1.0) -> float`` giving the learning-rate
*multiplier* at ``state.timestamp``. It is a pure function of the timestamp, so a resumed run gets
exactly the schedule it would have had. Times are ``Time`` objects or strings (``"10ep"``,
``"500ba"``, ``"0.3dur"``); ``dur`` is a fraction of ``state.max_duration``, and a time in unit X is
compared with ``state.timestamp.get(X)``. When the state knows its epoch length
(``state.dataloader_len``, batches per epoch, an int or a ``Time`` in ``ba``), epoch times are
turned into batches first, so an epoch-long schedule moves every batch as in Composer.

``ssr`` (the scale-schedule ratio) is Composer's: the Trainer scales ``max_duration`` by it, a
``dur`` time is a fraction of that scaled run (so ``1dur`` still ends with the run), and a time in
``ep``/``ba``/``sp``/``tok`` is stretched by ``ssr`` once (counts round down). Warmup is stretched
only when the scheduler was built with ``scale_warmup=True``. The warmup forms ramp linearly from
0 over ``t_warmup``, then decay over ``t_max - t_warmup`` measured from ``t_warmup``; one whose
``t_max`` ends before ``max_duration`` raises unless built with ``allow_short_t_max=True``.
A plain function ``f(state) -> float`` or ``f(state, ssr) -> float`` is a scheduler too.
:func:`compile_composer_scheduler` (from :mod:`kiln.optim.lr_scheduler`) turns any of them into a
torch ``LRScheduler`` the loop steps every batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kiln.core.time import Time, TimeUnit, _round_down, resolve_fraction
from kiln.optim.lr_scheduler import ComposerLRScheduler, compile_composer_scheduler, scale_torch_scheduler

__all__ = [
    "takes_optimizer",
    "ComposerScheduler",
    "ConstantScheduler",
    "StepScheduler",
    "MultiStepScheduler",
    "ExponentialScheduler",
    "LinearScheduler",
    "CosineAnnealingScheduler",
    "CosineAnnealingWarmRestartsScheduler",
    "PolynomialScheduler",
    "MultiStepWithWarmupScheduler",
    "ConstantWithWarmupScheduler",
    "LinearWithWarmupScheduler",
    "CosineAnnealingWithWarmupScheduler",
    "PolynomialWithWarmupScheduler",
    "compile_composer_scheduler",
    "ComposerLRScheduler",
    "scale_torch_scheduler",
]

TimeLike = Time | str


def _parse(value: TimeLike, name: str) -> Time:
    if isinstance(value, Time):
        return value
    if isinstance(value, str):
        return Time.from_timestring(value)
    raise TypeError(f"{name} must be a Time or a time string like '10ep' or '0.3dur', got {value!r}")


def _batches_per_epoch(state: Any) -> int | None:
    length = getattr(state, "dataloader_len", None)
    length = length.value if isinstance(length, Time) else length
    return int(length) if length else None


def _max_duration(state: Any) -> tuple[Time, int | None]:
    """``state.max_duration`` (in batches when it counts epochs and the epoch length is known), and
    the epoch length."""
    max_duration = state.max_duration
    if max_duration is None:
        raise ValueError("the scheduler needs state.max_duration to be set (e.g. '10ep' or '1000ba')")
    max_duration = _parse(max_duration, "state.max_duration")
    per_epoch = _batches_per_epoch(state)
    if per_epoch is not None and max_duration.unit == TimeUnit.EPOCH:
        max_duration = Time(max_duration.value * per_epoch, TimeUnit.BATCH)
    return max_duration, per_epoch


def _convert(time: Time, state: Any, ssr: float = 1.0) -> tuple[float, TimeUnit]:
    """``time`` as ``(value, unit)`` with ``unit`` countable by the timestamp (Composer's rule).

    ``dur`` is a fraction of ``state.max_duration``, which the Trainer has already scaled by the
    ratio, so it is never scaled again: a ``1dur`` schedule ends with the run whatever the ratio.
    Any other time is stretched by ``ssr`` once, and an integer count rounds down as in Composer
    (``25ba`` at 0.5 is 12 batches). Epochs become batches first when the epoch length is known,
    as ``1ep`` at 0.5 is half an epoch; without it they stay (fractional) epochs.
    """
    max_duration, per_epoch = _max_duration(state)
    if time.unit == TimeUnit.DURATION:
        time = resolve_fraction(time, max_duration)
        return float(time.value), time.unit
    value, unit = float(time.value), time.unit
    if per_epoch is not None and unit == TimeUnit.EPOCH:
        value, unit = value * per_epoch, TimeUnit.BATCH
    if ssr != 1.0:
        value *= ssr
        if unit in _COUNTED:
            value = float(_round_down(value))
    return value, unit


_COUNTED = frozenset({TimeUnit.BATCH, TimeUnit.SAMPLE, TimeUnit.TOKEN})


def _now(state: Any, unit: TimeUnit) -> float:
    return state.timestamp.get(unit).value


def _fraction(now: float, start: float, end: float) -> float:
    """How far ``now`` is through ``[start, end]``, clipped to 1; 0 when the span is empty."""
    return min(1.0, (now - start) / (end - start)) if end > start else 0.0


def _cosine(frac: float, alpha_f: float) -> float:
    return alpha_f + (1.0 - alpha_f) * (1.0 + math.cos(math.pi * frac)) / 2.0


def _polynomial(frac: float, power: float, alpha_f: float) -> float:
    return alpha_f + (1.0 - alpha_f) * (1.0 - frac) ** power


class ComposerScheduler:
    """Base of kiln's time-aware schedulers: ``scheduler(state, ssr=1.0) -> float``.

    Subclasses implement ``__call__`` as a pure function of ``state.timestamp`` and
    ``state.max_duration``, returning the multiplier applied to each optimizer's base learning
    rate. Any callable with that signature works where kiln takes a scheduler.

    Examples:
        >>> class Halve(ComposerScheduler):
        ...     def __call__(self, state, ssr=1.0):
        ...         return 0.5
        >>> Halve()(None)
        0.5
    """

    def __call__(self, state: Any, ssr: float = 1.0) -> float:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(state, ssr=1.0)")

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


def takes_optimizer(factory: Any) -> bool:
    """Whether a scheduler type named in a run file (``lr_scheduler.type``) is built with the
    optimizer as its first argument: torch's schedulers are; kiln's time-aware ones
    (:class:`ComposerScheduler`) read the Trainer's state instead and take none."""
    return not (isinstance(factory, type) and issubclass(factory, ComposerScheduler))


class ConstantScheduler(ComposerScheduler):
    """``alpha`` until ``t_max``, then 1.

    Examples:
        >>> ConstantScheduler(alpha=0.5, t_max="2ep")
        ConstantScheduler(alpha=0.5, t_max=Time(2, TimeUnit.EPOCH))
    """

    def __init__(self, alpha: float = 1.0, t_max: TimeLike = "1dur") -> None:
        self.alpha = alpha
        self.t_max = _parse(t_max, "t_max")

    def __call__(self, state: Any, ssr: float = 1.0) -> float:
        t_max, unit = _convert(self.t_max, state, ssr)
        return self.alpha if _now(state, unit) < t_max else 1.0


class StepScheduler(ComposerScheduler):
    """``gamma ** floor(t / step_size)``: decay by ``gamma`` every ``step_size``.

    Examples:
        >>> StepScheduler(step_size="30ep", gamma=0.1)
        StepScheduler(step_size=Time(30, TimeUnit.EPOCH), gamma=0.1)
    """

    def __init__(self, step_size: TimeLike, gamma: float = 0.1) -> None:
        self.step_size = _parse(step_size, "step_size")
        self.gamma = gamma

    def __call__(self, state: Any, ssr: float = 1.0) -> float:
        step, unit = _convert(self.step_size, state, ssr)
        if step <= 0:
            raise ValueError(
                f"StepScheduler step_size {self.step_size} resolves to {step} {unit.value}; it must be > 0"
            )
        return self.gamma ** math.floor(_now(state, unit) / step)


class MultiStepScheduler(ComposerScheduler):
    """Multiply by ``gamma`` at each milestone passed.

    Examples:
        >>> MultiStepScheduler(milestones=["0.3dur", "0.5dur", "0.9dur"], gamma=0.1)  # doctest: +ELLIPSIS
        MultiStepScheduler(milestones=[Time(0.3, TimeUnit.DURATION), ...], gamma=0.1)
    """

    def __init__(self, milestones: Sequence[TimeLike], gamma: float = 0.1) -> None:
        if isinstance(milestones, (str, Time)):
            raise TypeError(f"milestones must be a list of times, got {milestones!r}; wrap it: [{milestones!r}]")
        self.milestones = [_parse(m, "milestones") for m in milestones]
        self.gamma = gamma

    def __call__(self, state: Any, ssr: float = 1.0) -> float:
        factor = 1.0
        for milestone in self.milestones:
            value, unit = _convert(milestone, state, ssr)
            if _now(state, unit) >= value:
                factor *= self.gamma
        return factor


class ExponentialScheduler(ComposerScheduler):
    """``gamma ** (t / decay_period)``: smooth decay by ``gamma`` per ``decay_period``.

    Examples:
        >>> ExponentialScheduler(gamma=0.9)
        ExponentialScheduler(gamma=0.9, decay_period=Time(1, TimeUnit.EPOCH))
    """

    def __init__(self, gamma: float, decay_period: TimeLike = "1ep") -> None:
        self.gamma = gamma
        self.decay_period = _parse(decay_period, "decay_period")

    def __call__(self, state: Any, ssr: float = 1.0) -> float:
        period, unit = _convert(self.decay_period, state, ssr)
        if period <= 0:
            raise ValueError(f"ExponentialScheduler decay_period {self.decay_period} resolves to 0; it must be > 0")
        return self.gamma ** (_now(state, unit) / period)


class LinearScheduler(ComposerScheduler):
    """From ``alpha_i`` to ``alpha_f`` linearly over ``t_max``, then ``alpha_f``.

    Examples:
        >>> LinearScheduler(alpha_i=1.0, alpha_f=0.1, t_max="0.5dur")
        LinearScheduler(alpha_i=1.0, alpha_f=0.1, t_max=Time(0.5, TimeUnit.DURATION))
    """

    def __init__(self, alpha_i: float = 1.0, alpha_f: float = 0.0, t_max: TimeLike = "1dur") -> None:
        self.alpha_i = alpha_i
        self.alpha_f = alpha_f
        self.t_max = _parse(t_max, "t_max")

    def __call__(self, state: Any, ssr: float = 1.0) -> float:
        t_max, unit = _convert(self.t_max, state, ssr)
        frac = _fraction(_now(state, unit), 0.0, t_max) if t_max > 0 else 1.0
        return self.alpha_i + frac * (self.alpha_f - self.alpha_i)


class CosineAnnealingScheduler(ComposerScheduler):
    """``alpha_f + (1 - alpha_f) * (1 + cos(pi * t / t_max)) / 2``, then ``alpha_f``.

    Examples:
        >>> CosineAnnealingScheduler(t_max="1dur", alpha_f=0.01)
        CosineAnnealingScheduler(t_max=Time(1.0, TimeUnit.DURATION), alpha_f=0.01)
    """

    def __init__(self, t_max: TimeLike = "1dur", alpha_f: float = 0.0) -> None:
        self.t_max = _parse(t_max, "t_max")
        self.alpha_f = alpha_f

    def __call__(self, state: Any, ssr: float = 1.0) -> float:
        t_max, unit = _convert(self.t_max, state, ssr)
        frac = _fraction(_now(state, unit), 0.0, t_max) if t_max > 0 else 1.0
        return _cosine(frac, self.alpha_f)


class CosineAnnealingWarmRestartsScheduler(ComposerScheduler):
    """Cosine annealing that restarts: cycles last ``t_0``, ``t_0 * t_mult``, ``t_0 * t_mult**2``, ...

    Examples:
        >>> CosineAnnealingWarmRestartsScheduler(t_0="10ep", t_mult=2.0)
        CosineAnnealingWarmRestartsScheduler(t_0=Time(10, TimeUnit.EPOCH), t_mult=2.0, alpha_f=0.0)
    """

    def __init__(self, t_0: TimeLike, t_mult: float = 1.0, alpha_f: float = 0.0) -> None:
        if t_mult < 1.0:
            raise ValueError(f"t_mult must be >= 1 (cycles may not shrink), got {t_mult}")
        self.t_0 = _parse(t_0, "t_0")
        self.t_mult = t_mult
        self.alpha_f = alpha_f

    def __call__(self, state: Any, ssr: float = 1.0) -> float:
        cycle, unit = _convert(self.t_0, state, ssr)
        if cycle <= 0:
            raise ValueError(f"t_0 {self.t_0} resolves to 0; it must be > 0")
        since_restart = _now(state, unit)
        if self.t_mult == 1.0:
            since_restart = math.fmod(since_restart, cycle)
        else:  # cycles grow geometrically, so this loops O(log t) times
            while since_restart >= cycle:
                since_restart -= cycle
                # a counted cycle rounds down, as in Composer (10ba * 1.5 = 15ba, * 1.5 = 22ba)
                cycle = float(_round_down(cycle * self.t_mult)) if unit in _COUNTED else cycle * self.t_mult
                if cycle <= 0:
                    raise ValueError(f"t_0 {self.t_0} with t_mult {self.t_mult} gives a cycle of 0 {unit.value}")
        return _cosine(since_restart / cycle, self.alpha_f)


class PolynomialScheduler(ComposerScheduler):
    """``alpha_f + (1 - alpha_f) * (1 - t / t_max) ** power``, then ``alpha_f``.

    Examples:
        >>> PolynomialScheduler(power=2.0)
        PolynomialScheduler(power=2.0, t_max=Time(1.0, TimeUnit.DURATION), alpha_f=0.0)
    """

    def __init__(self, power: float, t_max: TimeLike = "1dur", alpha_f: float = 0.0) -> None:
        self.power = power
        self.t_max = _parse(t_max, "t_max")
        self.alpha_f = alpha_f

    def __call__(self, state: Any, ssr: float = 1.0) -> float:
        t_max, unit = _convert(self.t_max, state, ssr)
        frac = _fraction(_now(state, unit), 0.0, t_max) if t_max > 0 else 1.0
        return _polynomial(frac, self.power, self.alpha_f)


class _WithWarmup(ComposerScheduler):
    """Shared warmup logic: a linear ramp from 0 over ``t_warmup`` (stretched by ssr only if asked)."""

    t_max: Time

    def __init__(self, t_warmup: TimeLike, scale_warmup: bool, allow_short_t_max: bool = False) -> None:
        self.t_warmup = _parse(t_warmup, "t_warmup")
        self.scale_warmup = scale_warmup
        self.allow_short_t_max = allow_short_t_max

    def _warmup_end(self, state: Any, ssr: float) -> tuple[float, TimeUnit]:
        return _convert(self.t_warmup, state, ssr if self.scale_warmup else 1.0)

    def _check_t_max(self, t_max: float, unit: TimeUnit, state: Any, ssr: float) -> None:
        """Refuse a schedule that ends before the run (Composer raises too): past ``t_max`` the
        learning rate would silently hold its final value for the rest of training."""
        if self.allow_short_t_max:
            return
        max_duration, _ = _max_duration(state)
        if max_duration.unit == unit and t_max < max_duration.value:
            ratio = f" at scale_schedule_ratio={ssr:g}" if ssr != 1.0 else ""
            raise ValueError(
                f"{type(self).__name__}: t_max={self.t_max} ends at {t_max:g}{unit.value}{ratio}, before "
                f"max_duration ({max_duration.value:g}{unit.value}); the learning rate would hold its final value "
                "for the rest of the run. Give t_max >= max_duration (e.g. '1dur'), or pass allow_short_t_max=True "
                "to keep the short schedule"
            )

    def _progress(self, state: Any, ssr: float) -> tuple[bool, float]:
        """``(True, fraction of warmup done)`` in warmup, else ``(False, fraction of t_warmup..t_max done)``."""
        warmup, unit = self._warmup_end(state, ssr)
        t_max, max_unit = _convert(self.t_max, state, ssr)
        self._check_t_max(t_max, max_unit, state, ssr)
        now = _now(state, unit)
        if now < warmup:
            return True, now / warmup
        if max_unit != unit:
            raise ValueError(
                f"{type(self).__name__}: t_warmup {self.t_warmup} counts in '{unit.value}' but t_max {self.t_max} "
                f"in '{max_unit.value}'; give both in one unit, or set state.dataloader_len so epochs become batches"
            )
        return False, _fraction(now, warmup, t_max)


class MultiStepWithWarmupScheduler(_WithWarmup):
    """Linear warmup from 0 to 1 over ``t_warmup``, then :class:`MultiStepScheduler` (absolute milestones).

    Examples:
        >>> MultiStepWithWarmupScheduler(t_warmup="1ep", milestones=["10ep", "20ep"])  # doctest: +ELLIPSIS
        MultiStepWithWarmupScheduler(t_warmup=Time(1, TimeUnit.EPOCH), ..., milestones=[...], gamma=0.1)
    """

    def __init__(
        self, t_warmup: TimeLike, milestones: Sequence[TimeLike], gamma: float = 0.1, scale_warmup: bool = False
    ) -> None:
        super().__init__(t_warmup, scale_warmup)
        self._step = MultiStepScheduler(milestones, gamma)
        self.milestones = self._step.milestones
        self.gamma = gamma

    def __call__(self, state: Any, ssr: float = 1.0) -> float:
        warmup, unit = self._warmup_end(state, ssr)
        now = _now(state, unit)
        return now / warmup if now < warmup else self._step(state, ssr)


class LinearWithWarmupScheduler(_WithWarmup):
    """Warmup from 0 to ``alpha_i`` over ``t_warmup``, then linear from ``alpha_i`` to ``alpha_f`` at ``t_max``.

    Examples:
        >>> LinearWithWarmupScheduler(t_warmup="100ba", alpha_f=0.1)  # doctest: +ELLIPSIS
        LinearWithWarmupScheduler(t_warmup=Time(100, TimeUnit.BATCH), ..., alpha_f=0.1, t_max=...)
    """

    def __init__(
        self,
        t_warmup: TimeLike,
        alpha_i: float = 1.0,
        alpha_f: float = 0.0,
        t_max: TimeLike = "1dur",
        scale_warmup: bool = False,
        allow_short_t_max: bool = False,
    ) -> None:
        super().__init__(t_warmup, scale_warmup, allow_short_t_max)
        self.alpha_i = alpha_i
        self.alpha_f = alpha_f
        self.t_max = _parse(t_max, "t_max")

    def __call__(self, state: Any, ssr: float = 1.0) -> float:
        in_warmup, frac = self._progress(state, ssr)
        if in_warmup:  # ramp to alpha_i so the schedule is continuous where the decay starts
            return frac * self.alpha_i
        return self.alpha_i + frac * (self.alpha_f - self.alpha_i)


class ConstantWithWarmupScheduler(LinearWithWarmupScheduler):
    """Warmup from 0 to ``alpha`` over ``t_warmup``, then ``alpha`` (Composer: linear from alpha to alpha).

    Examples:
        >>> ConstantWithWarmupScheduler(t_warmup="0.1dur", alpha=0.5).alpha
        0.5
    """

    def __init__(
        self,
        t_warmup: TimeLike,
        alpha: float = 1.0,
        t_max: TimeLike = "1dur",
        scale_warmup: bool = False,
        allow_short_t_max: bool = False,
    ) -> None:
        super().__init__(
            t_warmup,
            alpha_i=alpha,
            alpha_f=alpha,
            t_max=t_max,
            scale_warmup=scale_warmup,
            allow_short_t_max=allow_short_t_max,
        )
        self.alpha = alpha


class CosineAnnealingWithWarmupScheduler(_WithWarmup):
    """Warmup from 0 to 1 over ``t_warmup``, then cosine from 1 to ``alpha_f`` at ``t_max``.

    Examples:
        >>> CosineAnnealingWithWarmupScheduler(t_warmup="0.05dur", alpha_f=0.1).alpha_f
        0.1
    """

    def __init__(
        self,
        t_warmup: TimeLike,
        t_max: TimeLike = "1dur",
        alpha_f: float = 0.0,
        scale_warmup: bool = False,
        allow_short_t_max: bool = False,
    ) -> None:
        super().__init__(t_warmup, scale_warmup, allow_short_t_max)
        self.t_max = _parse(t_max, "t_max")
        self.alpha_f = alpha_f

    def __call__(self, state: Any, ssr: float = 1.0) -> float:
        in_warmup, frac = self._progress(state, ssr)
        return frac if in_warmup else _cosine(frac, self.alpha_f)


class PolynomialWithWarmupScheduler(_WithWarmup):
    """Warmup from 0 to 1 over ``t_warmup``, then ``(1 - frac) ** power`` decay to ``alpha_f`` at ``t_max``.

    Examples:
        >>> PolynomialWithWarmupScheduler(t_warmup="500ba", power=1.0).power
        1.0
    """

    def __init__(
        self,
        t_warmup: TimeLike,
        power: float = 2.0,
        t_max: TimeLike = "1dur",
        alpha_f: float = 0.0,
        scale_warmup: bool = False,
        allow_short_t_max: bool = False,
    ) -> None:
        super().__init__(t_warmup, scale_warmup, allow_short_t_max)
        self.power = power
        self.t_max = _parse(t_max, "t_max")
        self.alpha_f = alpha_f

    def __call__(self, state: Any, ssr: float = 1.0) -> float:
        in_warmup, frac = self._progress(state, ssr)
        return frac if in_warmup else _polynomial(frac, self.power, self.alpha_f)
