"""Training time: units, values in a unit (:class:`Time`) and the loop's counters (:class:`Timestamp`)."""

from __future__ import annotations

import datetime
import functools
import math
import operator
import re
from collections.abc import Callable
from enum import Enum
from typing import Any

__all__ = ["TimeUnit", "Time", "Timestamp", "ensure_time", "resolve_fraction"]


class TimeUnit(str, Enum):
    """The units a training duration can be measured in.

    ``DURATION`` is a fraction of the run's ``max_duration``; ``SECOND`` is wall-clock time.
    """

    EPOCH = "ep"
    BATCH = "ba"
    SAMPLE = "sp"
    TOKEN = "tok"
    DURATION = "dur"
    SECOND = "sec"


_INT_UNITS = frozenset({TimeUnit.EPOCH, TimeUnit.BATCH, TimeUnit.SAMPLE, TimeUnit.TOKEN})
_UNIT_LIST = ", ".join(u.value for u in TimeUnit)
# Digits may be grouped with single underscores, as Python's float() and so Composer accept ("4_000tok").
_DIGITS = r"\d+(?:_\d+)*"
_NUMBER = rf"(?:{_DIGITS}\.?(?:{_DIGITS})?|\.{_DIGITS})(?:e[+-]?{_DIGITS})?"
_UNIT_RE = re.compile(rf"({_NUMBER})(ep|ba|sp|tok|dur|sec)")
_CLOCK_RE = re.compile(rf"(?:({_NUMBER})h)?(?:({_NUMBER})m)?(?:({_NUMBER})s)?")


def _bad_string(text: str, why: str = "") -> ValueError:
    reason = f" ({why})" if why else ""
    return ValueError(
        f"invalid time string {text!r}{reason}: expected a non-negative number followed by one of the "
        f"units {_UNIT_LIST} (e.g. '10ep', '500ba', '2e4sp', '0.3dur'), or a wall-clock duration "
        f"such as '1h30m', '90s' or '2h'"
    )


def _compare(op: Callable[[Any, Any], bool]) -> Callable[[Any, object], bool]:
    """An ordering method for Time and Timestamp built on their ``_compare_values``."""

    def method(self: Any, other: object) -> bool:
        pair = self._compare_values(other, "compare")
        return NotImplemented if pair is None else op(*pair)

    method.__name__ = f"__{op.__name__}__"
    return method


def _round_down(value: float) -> int:
    """``int(value)``, but forgiving float error: 0.29 * 100 is 28.999999999999996 and means 29."""
    nearest = round(value)
    return int(nearest) if abs(value - nearest) <= 1e-9 * max(1.0, abs(value)) else int(value)


def _format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


class Time:
    """An amount of training time in one unit.

    Integer units (``ep``, ``ba``, ``sp``, ``tok``) hold an ``int``; ``dur`` and ``sec`` hold a
    ``float``. Values are never negative. Comparison and arithmetic work within a unit (or against a
    plain number, taken to be in the same unit); ordering across units raises ``TypeError`` and
    ``==`` across units is ``False``.

    Args:
        value: the amount; a whole number for integer units.
        unit: a :class:`TimeUnit` or its string value (``"ep"``).

    Examples:
        >>> Time.from_timestring("2e4sp")
        Time(20000, TimeUnit.SAMPLE)
        >>> Time(10, TimeUnit.EPOCH) * 0.3
        Time(3, TimeUnit.EPOCH)
    """

    __slots__ = ("_value", "_unit")
    _value: int | float
    _unit: TimeUnit

    def __init__(self, value: int | float, unit: TimeUnit | str) -> None:
        if type(unit) is not TimeUnit:  # calling the Enum class runs Python code, even for a member
            try:
                unit = TimeUnit(unit)
            except ValueError:
                raise ValueError(f"unknown time unit {unit!r}; valid units are {_UNIT_LIST}") from None
        if type(value) is int and value >= 0 and unit in _INT_UNITS:
            # A count, as every Timestamp property builds one: valid as it is, without the checks below.
            self._value = value
            self._unit = unit
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"Time value must be an int or float, got {type(value).__name__} {value!r}")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"Time value must be a finite non-negative number, got {value!r} {unit.value}")
        if unit in _INT_UNITS:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(f"Time in {unit.value!r} must be a whole number, got {value!r}")
            value = int(value)
        else:
            value = float(value)
        self._value = value
        self._unit = unit

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_timestring(cls, text: str) -> Time:
        """Parse ``"10ep"``, ``"500ba"``, ``"2e4sp"``, ``"1e6tok"``, ``"0.3dur"``, ``"90sec"`` or
        wall-clock strings ``"1h30m"``, ``"90s"``, ``"2h"`` (parsed into ``sec``)."""
        if not isinstance(text, str):
            raise TypeError(f"from_timestring expects a str, got {type(text).__name__} {text!r}")
        if cls is not Time:
            return cls._parse(text)
        # A Time never changes, so one parse serves every fit(duration="1ep") and interval check.
        return _parse_timestring(text)

    @classmethod
    def _parse(cls, text: str) -> Time:
        s = text.strip().lower()
        if s.startswith("-"):
            raise _bad_string(text, "negative times are not allowed")
        match = _UNIT_RE.fullmatch(s)
        if match:
            number, unit = float(match.group(1).replace("_", "")), TimeUnit(match.group(2))
            if unit in _INT_UNITS and not number.is_integer():
                raise _bad_string(text, f"'{unit.value}' counts must be whole numbers")
            return cls(int(number) if unit in _INT_UNITS else number, unit)
        match = _CLOCK_RE.fullmatch(s)
        if s and match:
            hours, minutes, seconds = (float(g.replace("_", "")) if g else 0.0 for g in match.groups())
            return cls(hours * 3600.0 + minutes * 60.0 + seconds, TimeUnit.SECOND)
        raise _bad_string(text)

    @classmethod
    def from_input(cls, value: Time | str | int | float, default_int_unit: TimeUnit | str = TimeUnit.EPOCH) -> Time:
        """Accept a :class:`Time`, a time string, or a plain number in ``default_int_unit``."""
        if isinstance(value, Time):
            return value
        if isinstance(value, str):
            return cls.from_timestring(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return cls(value, default_int_unit)
        raise TypeError(f"expected a Time, a time string like '10ep' or a number, got {type(value).__name__} {value!r}")

    @classmethod
    def from_epoch(cls, epoch: int) -> Time:
        return cls(epoch, TimeUnit.EPOCH)

    @classmethod
    def from_batch(cls, batch: int) -> Time:
        return cls(batch, TimeUnit.BATCH)

    @classmethod
    def from_sample(cls, sample: int) -> Time:
        return cls(sample, TimeUnit.SAMPLE)

    @classmethod
    def from_token(cls, token: int) -> Time:
        return cls(token, TimeUnit.TOKEN)

    @classmethod
    def from_duration(cls, duration: float) -> Time:
        return cls(duration, TimeUnit.DURATION)

    @classmethod
    def from_second(cls, seconds: float) -> Time:
        return cls(seconds, TimeUnit.SECOND)

    # -- access -------------------------------------------------------------------------------
    @property
    def value(self) -> int | float:
        return self._value

    @property
    def unit(self) -> TimeUnit:
        return self._unit

    def to_timestring(self) -> str:
        """The string form that :meth:`from_timestring` parses back, e.g. ``"10ep"``."""
        return f"{_format_number(self._value)}{self._unit.value}"

    def __str__(self) -> str:
        return self.to_timestring()

    def __repr__(self) -> str:
        return f"Time({self._value!r}, TimeUnit.{self._unit.name})"

    def __hash__(self) -> int:
        # Hash the value alone so that Time(3, "ep") == 3 implies equal hashes.
        return hash(self._value)

    def __int__(self) -> int:
        return int(self._value)

    def __float__(self) -> float:
        return float(self._value)

    # -- comparison and arithmetic ------------------------------------------------------------
    def _compare_values(self, other: object, op: str) -> tuple[int | float, int | float] | None:
        value = self._other_value(other, op)
        return None if value is None else (self._value, value)

    def _other_value(self, other: Any, op: str) -> int | float | None:
        """The other operand's value in this unit; ``None`` if it is not a time or a number."""
        if isinstance(other, str):
            other = Time.from_timestring(other)
        if isinstance(other, Time):
            if other._unit != self._unit:
                raise TypeError(
                    f"cannot {op} Time({_format_number(self._value)}, {self._unit.value}) "
                    f"with Time({_format_number(other._value)}, {other._unit.value}): units differ"
                )
            return other._value
        if isinstance(other, (int, float)) and not isinstance(other, bool):
            return other
        return None

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            try:
                other = Time.from_timestring(other)
            except ValueError:  # an unparsable string is simply not equal
                return False
        if isinstance(other, Time):
            return self._unit == other._unit and self._value == other._value
        if isinstance(other, (int, float)) and not isinstance(other, bool):
            return self._value == other
        return NotImplemented

    __lt__ = _compare(operator.lt)
    __le__ = _compare(operator.le)
    __gt__ = _compare(operator.gt)
    __ge__ = _compare(operator.ge)

    def _scaled(self, value: float) -> Time:
        # Integer units round down, as fractions of a batch or epoch do not exist.
        return Time(_round_down(value) if self._unit in _INT_UNITS else value, self._unit)

    def __add__(self, other: object) -> Time:
        value = self._other_value(other, "add")
        return NotImplemented if value is None else Time(self._value + value, self._unit)

    __radd__ = __add__

    def __sub__(self, other: object) -> Time:
        value = self._other_value(other, "subtract")
        if value is None:
            return NotImplemented
        if value > self._value:
            raise ValueError(f"{self} - {_format_number(value)}{self._unit.value} would be negative")
        return Time(self._value - value, self._unit)

    def __rsub__(self, other: object) -> Time:
        value = self._other_value(other, "subtract")
        return NotImplemented if value is None else Time(value, self._unit) - self

    def __mul__(self, other: object) -> Time:
        if isinstance(other, bool) or not isinstance(other, (int, float)):
            if isinstance(other, Time):
                raise TypeError(f"cannot multiply {self!r} by {other!r}: multiply a Time by a number")
            return NotImplemented
        return self._scaled(self._value * other)

    __rmul__ = __mul__

    def __truediv__(self, other: object) -> Time | float:
        if isinstance(other, (Time, str)):
            value = self._other_value(other, "divide")
            assert value is not None  # a Time or a time string always has a value
            return self._value / value
        if isinstance(other, bool) or not isinstance(other, (int, float)):
            return NotImplemented
        return self._scaled(self._value / other)


@functools.lru_cache(maxsize=256)
def _parse_timestring(text: str) -> Time:
    return Time._parse(text)


def ensure_time(value: Time | str | int | float, default_unit: TimeUnit | str) -> Time:
    """Turn a :class:`Time`, a time string or a number in ``default_unit`` into a :class:`Time`."""
    return Time.from_input(value, default_unit)


def resolve_fraction(time: Time, max_duration: Time) -> Time:
    """Express a ``dur`` time in ``max_duration``'s unit; other times are returned unchanged.

    ``resolve_fraction(Time(0.3, "dur"), Time(10, "ep"))`` is ``Time(3, ep)``; integer units round down.
    """
    if time.unit != TimeUnit.DURATION:
        return time
    if max_duration.unit == TimeUnit.DURATION:
        raise ValueError(f"max_duration must not itself be a fraction of the run, got {max_duration}")
    value = time.value * max_duration.value
    return Time(_round_down(value) if max_duration.unit in _INT_UNITS else value, max_duration.unit)


_COUNTERS = ("epoch", "batch", "sample", "token", "batch_in_epoch", "sample_in_epoch", "token_in_epoch")
_CLOCKS = ("total_wct", "epoch_wct", "batch_wct")
_FIELDS = _COUNTERS + _CLOCKS
_UNIT_FIELD = {
    TimeUnit.EPOCH: "_epoch",
    TimeUnit.BATCH: "_batch",
    TimeUnit.SAMPLE: "_sample",
    TimeUnit.TOKEN: "_token",
    TimeUnit.SECOND: "_total_wct",
}


def _seconds(value: Any) -> float:
    """Wall-clock seconds from a float, a ``datetime.timedelta`` (Composer's clocks) or ``None`` (0)."""
    if value is None:
        return 0.0
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    return float(value)


def _count(value: Any, name: str) -> int:
    """A per-batch count: an int or a :class:`Time` (Composer passes either)."""
    value = value.value if isinstance(value, Time) else value
    try:
        count = -1 if isinstance(value, bool) else operator.index(value)
    except TypeError:
        count = -1
    if count < 0:
        raise ValueError(f"{name}={value!r} must be a non-negative int (or a Time) counting this batch's {name}")
    return count


def _counter(field: str, unit: TimeUnit, doc: str) -> property:
    return property(lambda self: Time(getattr(self, field), unit), doc=doc)


class Timestamp:
    """Where the run is: counts of epochs, batches, samples and tokens, plus wall-clock seconds.

    Counters are plain ints inside (the loop advances them every batch); the properties build a
    :class:`Time` on access, so ``timestamp.batch.value`` is an ``int``. ``total_wct``, ``epoch_wct``
    and ``batch_wct`` are float seconds (``batch_wct`` is the duration of the last batch).
    Comparing a Timestamp with a :class:`Time` compares the counter in that Time's unit.

    Args:
        epoch, batch, sample, token, batch_in_epoch, sample_in_epoch, token_in_epoch: starting
            counts (ints or :class:`Time`).
        total_wct, epoch_wct, batch_wct: starting wall-clock seconds.

    Examples:
        >>> ts = Timestamp()
        >>> ts.advance_batch(samples=32, tokens=4096, duration=0.5)
        >>> ts.batch, ts.sample.value, ts >= Time(1, "ba")
        (Time(1, TimeUnit.BATCH), 32, True)
    """

    # The run's counters, and where they stood when this epoch began: a batch bumps five slots
    # (four without tokens), and the in-epoch counters are the differences, read far less often.
    __slots__ = (
        "_epoch",
        "_batch",
        "_sample",
        "_token",
        "_total_wct",
        "_batch_wct",
        "_epoch_batch",
        "_epoch_sample",
        "_epoch_token",
        "_epoch_start_wct",
    )
    _epoch: int
    _batch: int
    _sample: int
    _token: int
    _total_wct: float
    _batch_wct: float
    _epoch_batch: int
    _epoch_sample: int
    _epoch_token: int
    _epoch_start_wct: float

    def __init__(
        self,
        epoch: int | Time = 0,
        batch: int | Time = 0,
        sample: int | Time = 0,
        token: int | Time = 0,
        batch_in_epoch: int | Time = 0,
        sample_in_epoch: int | Time = 0,
        token_in_epoch: int | Time = 0,
        total_wct: float = 0.0,
        epoch_wct: float = 0.0,
        batch_wct: float = 0.0,
    ) -> None:
        values = locals()
        self.load_state_dict({name: values[name] for name in _FIELDS})

    # -- the in-epoch values, as plain numbers ---------------------------------------------------
    @property
    def _batch_in_epoch(self) -> int:
        return self._batch - self._epoch_batch

    @property
    def _sample_in_epoch(self) -> int:
        return self._sample - self._epoch_sample

    @property
    def _token_in_epoch(self) -> int:
        return self._token - self._epoch_token

    @property
    def _epoch_wct(self) -> float:
        return self._total_wct - self._epoch_start_wct

    # -- counters as Time (built on access; the ints inside stay cheap to bump) ----------------
    epoch = _counter("_epoch", TimeUnit.EPOCH, "Epochs completed.")
    batch = _counter("_batch", TimeUnit.BATCH, "Batches (optimizer steps) completed in the run.")
    sample = _counter("_sample", TimeUnit.SAMPLE, "Samples trained on in the run.")
    token = _counter("_token", TimeUnit.TOKEN, "Tokens trained on in the run.")
    batch_in_epoch = _counter("_batch_in_epoch", TimeUnit.BATCH, "Batches completed in this epoch.")
    sample_in_epoch = _counter("_sample_in_epoch", TimeUnit.SAMPLE, "Samples trained on in this epoch.")
    token_in_epoch = _counter("_token_in_epoch", TimeUnit.TOKEN, "Tokens trained on in this epoch.")
    total_wct = property(operator.attrgetter("_total_wct"), doc="Wall-clock seconds of training in the run.")
    epoch_wct = property(operator.attrgetter("_epoch_wct"), doc="Wall-clock seconds of training in this epoch.")
    batch_wct = property(operator.attrgetter("_batch_wct"), doc="Wall-clock seconds of the last batch.")

    def get(self, unit: TimeUnit | str) -> Time:
        """The elapsed time in ``unit`` (``ep``, ``ba``, ``sp``, ``tok`` or ``sec`` = ``total_wct``)."""
        if type(unit) is not TimeUnit:
            unit = TimeUnit(unit)
        field = _UNIT_FIELD.get(unit)
        if field is None:  # the one unit without a field
            raise ValueError(
                "a Timestamp cannot give 'dur' on its own; resolve the Time against max_duration "
                "with resolve_fraction(time, max_duration) first"
            )
        return Time(getattr(self, field), unit)

    # -- the hot path ---------------------------------------------------------------------------
    def advance_batch(
        self, samples: int | Time = 0, tokens: int | Time = 0, duration: float | datetime.timedelta | None = 0.0
    ) -> None:
        """Count one finished batch of ``samples`` samples and ``tokens`` tokens that took ``duration``.

        The arguments are those of Composer's ``Timestamp.to_next_batch``: counts may be ints or
        :class:`Time`, ``duration`` float seconds, a ``datetime.timedelta`` or ``None`` (0).
        """
        if type(samples) is not int or type(tokens) is not int or type(duration) is not float:
            samples, tokens, duration = _count(samples, "samples"), _count(tokens, "tokens"), _seconds(duration)
        self._batch += 1
        self._sample += samples
        self._token += tokens
        self._total_wct += duration
        self._batch_wct = duration

    def advance_epoch(self, duration: float | datetime.timedelta | None = None) -> None:
        """Count one finished epoch: reset the in-epoch counters, ``epoch_wct`` and ``batch_wct``.

        ``duration`` (Composer's ``to_next_epoch`` argument) is time spent outside the batches,
        added to ``total_wct``.
        """
        self._epoch += 1
        self._total_wct += _seconds(duration)
        self._epoch_batch, self._epoch_sample, self._epoch_token = self._batch, self._sample, self._token
        self._epoch_start_wct = self._total_wct
        self._batch_wct = 0.0

    def to_next_batch(
        self, samples: int | Time = 0, tokens: int | Time = 0, duration: float | datetime.timedelta | None = None
    ) -> Timestamp:
        """A new Timestamp one batch on (Composer's immutable form of :meth:`advance_batch`)."""
        following = self.copy()
        following.advance_batch(samples, tokens, duration)
        return following

    def to_next_epoch(self, duration: float | datetime.timedelta | None = None) -> Timestamp:
        """A new Timestamp one epoch on (Composer's immutable form of :meth:`advance_epoch`)."""
        following = self.copy()
        following.advance_epoch(duration)
        return following

    # -- state --------------------------------------------------------------------------------
    def copy(self, **fields: int | float | Time | datetime.timedelta | None) -> Timestamp:
        """A copy, with the named fields replaced (Composer's ``copy(epoch=..., batch_wct=...)``).

        A field given as ``None`` keeps its value, as in Composer.

        Examples:
            >>> Timestamp(epoch=2, batch=10).copy(batch=Time(12, "ba")).batch.value
            12
        """
        unknown = sorted(set(fields) - set(_FIELDS))
        if unknown:
            raise TypeError(f"Timestamp.copy() got unknown field(s) {unknown}; the fields are {list(_FIELDS)}")
        values: dict[str, Any] = self.state_dict()
        for name, value in fields.items():
            if value is not None:
                values[name] = _seconds(value) if name in _CLOCKS else value
        return Timestamp(**values)

    def state_dict(self) -> dict[str, int | float]:
        return {name: getattr(self, "_" + name) for name in _FIELDS}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; missing keys are zero, unknown keys are an error."""
        unknown = set(state_dict) - set(_FIELDS)
        if unknown:
            raise ValueError(f"unknown Timestamp keys {sorted(unknown)}; expected {list(_FIELDS)}")
        counts: dict[str, Any] = {}
        for name in _COUNTERS:
            value: Any = state_dict.get(name, 0)
            value = value.value if isinstance(value, Time) else value
            try:  # operator.index also takes numpy and 0-d tensor ints from a loaded checkpoint
                count = -1 if isinstance(value, bool) else operator.index(value)
            except TypeError:
                count = -1
            if count < 0:
                raise ValueError(f"Timestamp.{name} must be a non-negative int, got {value!r}")
            counts[name] = count
        clocks = {name: _seconds(state_dict.get(name, 0.0)) for name in _CLOCKS}
        self._epoch, self._batch, self._sample, self._token = (counts[n] for n in ("epoch", "batch", "sample", "token"))
        self._epoch_batch = self._batch - counts["batch_in_epoch"]
        self._epoch_sample = self._sample - counts["sample_in_epoch"]
        self._epoch_token = self._token - counts["token_in_epoch"]
        self._total_wct, self._batch_wct = clocks["total_wct"], clocks["batch_wct"]
        self._epoch_start_wct = self._total_wct - clocks["epoch_wct"]

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, '_' + name)!r}" for name in _FIELDS)
        return f"Timestamp({fields})"

    # -- comparison with a Time (``state.timestamp >= milestone``) ------------------------------
    def _compare_values(self, other: object, op: str) -> tuple[int | float, int | float] | None:
        if isinstance(other, str):
            other = Time.from_timestring(other)
        if not isinstance(other, Time):
            return None
        return self.get(other.unit).value, other.value  # get() refuses 'dur'

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Timestamp):
            return self.state_dict() == other.state_dict()
        pair = self._compare_values(other, "compare")
        return NotImplemented if pair is None else pair[0] == pair[1]

    __hash__ = None  # type: ignore[assignment]  # mutable

    __lt__ = _compare(operator.lt)
    __le__ = _compare(operator.le)
    __gt__ = _compare(operator.gt)
    __ge__ = _compare(operator.ge)
