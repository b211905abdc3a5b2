"""Tests for kiln.core.time: parsing, Time arithmetic and comparison, Timestamp, resolve_fraction."""

import pickle

import pytest

from kiln.core.time import Time, Timestamp, TimeUnit, ensure_time, resolve_fraction


@pytest.mark.parametrize(
    ("text", "value", "unit"),
    [
        ("10ep", 10, TimeUnit.EPOCH),
        ("500ba", 500, TimeUnit.BATCH),
        ("20000sp", 20000, TimeUnit.SAMPLE),
        ("2e4sp", 20000, TimeUnit.SAMPLE),
        ("1e6tok", 1_000_000, TimeUnit.TOKEN),
        ("0.3dur", 0.3, TimeUnit.DURATION),
        ("1dur", 1.0, TimeUnit.DURATION),
        (".5dur", 0.5, TimeUnit.DURATION),
        ("90sec", 90.0, TimeUnit.SECOND),
        ("0ba", 0, TimeUnit.BATCH),
        (" 7EP ", 7, TimeUnit.EPOCH),
    ],
)
def test_parse_units(text, value, unit):
    t = Time.from_timestring(text)
    assert t.unit is unit
    assert t.value == value
    assert type(t.value) is (float if unit in (TimeUnit.DURATION, TimeUnit.SECOND) else int)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("1h30m", 5400.0), ("90s", 90.0), ("2h", 7200.0), ("1h30m15s", 5415.0), ("45m", 2700.0), ("1.5h", 5400.0)],
)
def test_parse_wall_clock(text, seconds):
    assert Time.from_timestring(text) == Time(seconds, TimeUnit.SECOND)
    assert Time.from_timestring(text).unit is TimeUnit.SECOND


@pytest.mark.parametrize("bad", ["10", "ep", "10eps", "-3ba", "1.5ba", "", "abc", "1h30x", "2.5ep", "10 ep"])
def test_bad_strings_raise_value_error_naming_string_and_units(bad):
    with pytest.raises(ValueError) as info:
        Time.from_timestring(bad)
    message = str(info.value)
    assert repr(bad) in message
    for unit in ("ep", "ba", "sp", "tok", "dur", "sec"):
        assert unit in message


def test_non_integer_count_message_says_why():
    with pytest.raises(ValueError, match="'ba' counts must be whole numbers"):
        Time.from_timestring("1.5ba")
    with pytest.raises(ValueError, match="negative"):
        Time.from_timestring("-3ba")


def test_constructor_validation():
    assert Time(3, "ep") == Time(3, TimeUnit.EPOCH)
    assert Time(2.0, TimeUnit.BATCH).value == 2 and type(Time(2.0, TimeUnit.BATCH).value) is int
    assert type(Time(1, TimeUnit.DURATION).value) is float
    with pytest.raises(ValueError, match="non-negative"):
        Time(-1, TimeUnit.BATCH)
    with pytest.raises(ValueError, match="whole number"):
        Time(1.5, TimeUnit.EPOCH)
    with pytest.raises(ValueError, match="unknown time unit 'epochs'"):
        Time(1, "epochs")
    with pytest.raises(TypeError):
        Time("3", TimeUnit.EPOCH)
    with pytest.raises(TypeError):
        Time(True, TimeUnit.EPOCH)


def test_convenience_constructors_and_from_input():
    assert Time.from_epoch(3) == Time(3, TimeUnit.EPOCH)
    assert Time.from_batch(4) == Time(4, TimeUnit.BATCH)
    assert Time.from_sample(5) == Time(5, TimeUnit.SAMPLE)
    assert Time.from_token(6) == Time(6, TimeUnit.TOKEN)
    assert Time.from_duration(0.5) == Time(0.5, TimeUnit.DURATION)
    assert Time.from_input(5) == Time(5, TimeUnit.EPOCH)
    assert Time.from_input(5, TimeUnit.BATCH) == Time(5, TimeUnit.BATCH)
    assert Time.from_input("3ba") == Time(3, TimeUnit.BATCH)
    t = Time(2, TimeUnit.TOKEN)
    assert Time.from_input(t) is t
    assert ensure_time(7, TimeUnit.SAMPLE) == Time(7, TimeUnit.SAMPLE)
    assert ensure_time("0.25dur", TimeUnit.EPOCH) == Time(0.25, TimeUnit.DURATION)
    with pytest.raises(TypeError):
        Time.from_input([3])


def test_repr_str_round_trip():
    assert repr(Time(10, TimeUnit.EPOCH)) == "Time(10, TimeUnit.EPOCH)"
    assert repr(Time(0.3, TimeUnit.DURATION)) == "Time(0.3, TimeUnit.DURATION)"
    assert str(Time(10, TimeUnit.EPOCH)) == "10ep"
    assert Time(500, TimeUnit.BATCH).to_timestring() == "500ba"
    assert str(Time(0.3, TimeUnit.DURATION)) == "0.3dur"
    assert str(Time.from_timestring("1h30m")) == "5400sec"
    for text in ["10ep", "500ba", "20000sp", "1000000tok", "0.3dur", "5400sec"]:
        assert Time.from_timestring(text).to_timestring() == text


def test_comparison_within_unit_and_with_numbers():
    a, b = Time(3, TimeUnit.BATCH), Time(5, TimeUnit.BATCH)
    assert a < b and a <= b and b > a and b >= a and a != b
    assert a <= Time(3, TimeUnit.BATCH) and a >= Time(3, TimeUnit.BATCH)
    assert a == 3 and a < 4 and a > 2.5 and a <= 3 and a >= 3
    assert a == "3ba" and a < "4ba"
    assert a != "3ep"
    assert a != "not a time"
    assert sorted([b, a]) == [a, b]


@pytest.mark.parametrize("op", ["<", "<=", ">", ">="])
def test_ordering_across_units_raises(op):
    with pytest.raises(TypeError) as info:
        eval(f"x {op} y", {"x": Time(3, TimeUnit.EPOCH), "y": Time(5, TimeUnit.BATCH)})
    assert str(info.value) == "cannot compare Time(3, ep) with Time(5, ba): units differ"


def test_equality_across_units_is_false():
    assert (Time(3, TimeUnit.EPOCH) == Time(3, TimeUnit.BATCH)) is False
    assert (Time(3, TimeUnit.EPOCH) != Time(3, TimeUnit.BATCH)) is True


def test_hashable():
    assert hash(Time(3, TimeUnit.EPOCH)) == hash(Time(3, TimeUnit.EPOCH))
    assert hash(Time(3, TimeUnit.EPOCH)) == hash(3)
    assert {Time(3, TimeUnit.EPOCH), Time(3, TimeUnit.EPOCH), Time(3, TimeUnit.BATCH)} == {
        Time(3, TimeUnit.EPOCH),
        Time(3, TimeUnit.BATCH),
    }
    assert pickle.loads(pickle.dumps(Time(4, TimeUnit.TOKEN))) == Time(4, TimeUnit.TOKEN)


def test_arithmetic_within_unit():
    a, b = Time(3, TimeUnit.BATCH), Time(5, TimeUnit.BATCH)
    assert a + b == Time(8, TimeUnit.BATCH)
    assert b - a == Time(2, TimeUnit.BATCH)
    assert a + 2 == Time(5, TimeUnit.BATCH) and 2 + a == Time(5, TimeUnit.BATCH)
    assert 10 - a == Time(7, TimeUnit.BATCH)
    assert a * 4 == Time(12, TimeUnit.BATCH) and 4 * a == Time(12, TimeUnit.BATCH)
    assert Time(10, TimeUnit.EPOCH) * 0.3 == Time(3, TimeUnit.EPOCH)
    assert Time(7, TimeUnit.BATCH) * 0.5 == Time(3, TimeUnit.BATCH)  # integer units round down
    assert Time(10, TimeUnit.BATCH) / 4 == Time(2, TimeUnit.BATCH)
    assert b / a == 5 / 3
    assert Time(10, TimeUnit.BATCH) / Time(4, TimeUnit.BATCH) == 2.5
    assert Time(0.5, TimeUnit.DURATION) * 0.5 == Time(0.25, TimeUnit.DURATION)
    assert Time(1, TimeUnit.DURATION) - Time(0.25, TimeUnit.DURATION) == Time(0.75, TimeUnit.DURATION)
    assert type((a + b).value) is int


def test_arithmetic_errors():
    with pytest.raises(TypeError, match="cannot add Time\\(3, ep\\) with Time\\(5, ba\\): units differ"):
        Time(3, TimeUnit.EPOCH) + Time(5, TimeUnit.BATCH)
    with pytest.raises(TypeError, match="units differ"):
        Time(3, TimeUnit.EPOCH) - Time(1, TimeUnit.BATCH)
    with pytest.raises(TypeError, match="units differ"):
        Time(3, TimeUnit.EPOCH) / Time(1, TimeUnit.BATCH)
    with pytest.raises(TypeError):
        Time(3, TimeUnit.EPOCH) * Time(1, TimeUnit.EPOCH)
    with pytest.raises(ValueError, match="would be negative"):
        Time(3, TimeUnit.BATCH) - Time(5, TimeUnit.BATCH)


def test_resolve_fraction():
    assert resolve_fraction(Time(0.3, TimeUnit.DURATION), Time(10, TimeUnit.EPOCH)) == Time(3, TimeUnit.EPOCH)
    assert resolve_fraction(Time(0.3, TimeUnit.DURATION), Time(1000, TimeUnit.BATCH)) == Time(300, TimeUnit.BATCH)
    assert resolve_fraction(Time(0.29, TimeUnit.DURATION), Time(100, TimeUnit.BATCH)) == Time(29, TimeUnit.BATCH)
    assert resolve_fraction(Time(0.25, TimeUnit.DURATION), Time(10, TimeUnit.EPOCH)) == Time(2, TimeUnit.EPOCH)
    assert resolve_fraction(Time(0.5, TimeUnit.DURATION), Time.from_timestring("1h")) == Time(1800.0, TimeUnit.SECOND)
    t = Time(7, TimeUnit.SAMPLE)
    assert resolve_fraction(t, Time(10, TimeUnit.EPOCH)) is t
    with pytest.raises(ValueError):
        resolve_fraction(Time(0.5, TimeUnit.DURATION), Time(1.0, TimeUnit.DURATION))


def test_timestamp_starts_at_zero_and_properties_are_time():
    ts = Timestamp()
    for name, unit in [
        ("epoch", TimeUnit.EPOCH),
        ("batch", TimeUnit.BATCH),
        ("sample", TimeUnit.SAMPLE),
        ("token", TimeUnit.TOKEN),
        ("batch_in_epoch", TimeUnit.BATCH),
        ("sample_in_epoch", TimeUnit.SAMPLE),
        ("token_in_epoch", TimeUnit.TOKEN),
    ]:
        value = getattr(ts, name)
        assert value == Time(0, unit) and value.unit is unit and type(value.value) is int
    assert (ts.total_wct, ts.epoch_wct, ts.batch_wct) == (0.0, 0.0, 0.0)


def test_timestamp_advance_and_epoch_rollover():
    ts = Timestamp()
    ts.advance_batch(samples=8, tokens=100, duration=0.5)
    ts.advance_batch(samples=8, tokens=120, duration=0.25)
    assert ts.batch.value == 2 and ts.sample.value == 16 and ts.token.value == 220
    assert ts.batch_in_epoch.value == 2 and ts.sample_in_epoch.value == 16 and ts.token_in_epoch.value == 220
    assert (ts.total_wct, ts.epoch_wct, ts.batch_wct) == (0.75, 0.75, 0.25)
    ts.advance_epoch()
    assert ts.epoch == Time(1, TimeUnit.EPOCH)
    assert ts.batch.value == 2 and ts.sample.value == 16 and ts.token.value == 220
    assert ts.batch_in_epoch.value == 0 and ts.sample_in_epoch.value == 0 and ts.token_in_epoch.value == 0
    assert (ts.total_wct, ts.epoch_wct) == (0.75, 0.0)
    ts.advance_batch(samples=4)
    assert ts.batch.value == 3 and ts.batch_in_epoch.value == 1 and ts.sample.value == 20
    assert ts.token.value == 220 and ts.token_in_epoch.value == 0


def test_timestamp_get_and_compare_with_time():
    ts = Timestamp(epoch=2, batch=30, sample=300, token=3000, total_wct=12.5)
    assert ts.get(TimeUnit.EPOCH) == Time(2, TimeUnit.EPOCH)
    assert ts.get("ba") == Time(30, TimeUnit.BATCH)
    assert ts.get(TimeUnit.SAMPLE) == Time(300, TimeUnit.SAMPLE)
    assert ts.get(TimeUnit.TOKEN) == Time(3000, TimeUnit.TOKEN)
    assert ts.get(TimeUnit.SECOND) == Time(12.5, TimeUnit.SECOND)
    with pytest.raises(ValueError, match="resolve_fraction"):
        ts.get(TimeUnit.DURATION)
    assert ts >= Time(30, TimeUnit.BATCH) and ts < Time(31, TimeUnit.BATCH)
    assert ts > Time(1, TimeUnit.EPOCH) and ts <= "2ep" and ts == Time(300, TimeUnit.SAMPLE)


def test_timestamp_state_dict_round_trip_and_copy():
    ts = Timestamp()
    for _ in range(3):
        ts.advance_batch(samples=5, tokens=7, duration=0.125)
    ts.advance_epoch()
    ts.advance_batch(samples=5, tokens=7, duration=0.125)
    sd = ts.state_dict()
    assert sd == {
        "epoch": 1,
        "batch": 4,
        "sample": 20,
        "token": 28,
        "batch_in_epoch": 1,
        "sample_in_epoch": 5,
        "token_in_epoch": 7,
        "total_wct": 0.5,
        "epoch_wct": 0.125,
        "batch_wct": 0.125,
    }
    assert all(type(v) in (int, float) for v in sd.values())
    restored = Timestamp()
    restored.load_state_dict(sd)
    assert restored == ts and restored.state_dict() == sd
    copy = ts.copy()
    copy.advance_batch(samples=1)
    assert ts.batch.value == 4 and copy.batch.value == 5
    with pytest.raises(ValueError, match="unknown Timestamp keys"):
        Timestamp().load_state_dict({"epochs": 1})
    with pytest.raises(ValueError, match="non-negative int"):
        Timestamp().load_state_dict({"batch": -1})
    assert "batch=4" in repr(ts)
