"""Progress on rank 0: a tqdm bar over the whole run on a terminal, plain lines in a log file."""

from __future__ import annotations

import math
import sys
import time
from typing import TYPE_CHECKING, Any

from kiln.core.time import Time, TimeUnit

if TYPE_CHECKING:
    from kiln.loggers.logger import Logger

__all__ = ["ProgressBar", "parse_console_interval"]

_READ_EVERY = 1.0  # seconds: the bar reads an unlogged loss at most this often


def parse_console_interval(value: Any) -> Time | None:
    """``console_interval`` as a Time in seconds or batches; ``None`` (or ``False``): no lines.

    A number is seconds; strings are wall-clock times (``"30s"``, ``"2m"``, ``"1h30m"``) or
    batches (``"100ba"``). Anything else raises ``ValueError`` naming the value."""
    if value is None or value is False:
        return None
    expected = "a wall-clock time like '30s' or '5m', a number of batches like '100ba', or None (no lines)"
    if isinstance(value, bool):
        raise ValueError(f"console_interval={value!r} must be {expected}")
    try:
        interval = Time.from_input(value, TimeUnit.SECOND)
    except (ValueError, TypeError):
        raise ValueError(f"console_interval={value!r} must be {expected}") from None
    if interval.unit not in (TimeUnit.SECOND, TimeUnit.BATCH) or interval.value <= 0:
        raise ValueError(f"console_interval={value!r} must be {expected}")
    return interval


class ProgressBar:
    """What a run shows of its progress, on rank 0.

    Two displays, each where it can be read:

    * **the bar** (when its stream, ``sys.stderr`` by default, is a terminal): one tqdm bar for the
      run, counted in the unit of ``max_duration`` (batches for ``ba`` and ``ep``, samples, tokens), so
      its total and its remaining time are the run's, not an epoch's::

          epoch 2/10:  14%|█▍        | 140/1000 [00:35<03:35, 3.99ba/s, loss=0.231, lr=0.001, sp/s=505, eta=03:31]

    * **lines** (when stdout is not a terminal: ``> log.txt``, ``nohup``, a SLURM job log, ``| tee``),
      each with the time of day and flushed at once::

          14:02:03 training started: first step done 3.21 s into fit(); 199 steps to go
          14:02:33 step 48/200 (24%)  loss 3.412  lr 0.003  1.23e+04 tok/s  eta 01:35
          14:03:20 eval starts at step 100 (20 batches)
          14:04:20 eval done in 60.0 s: eval/loss 3.1  eval/Accuracy 0.41
          14:05:29 done: step 200/200 (100%) in 03:26 (02:20 training), loss 3.01, eval/loss 3.1; last checkpoint runs/ep0-ba200

      A step line comes every ``console_interval`` (``"30s"``; ``"100ba"`` counts batches) and at
      each tenth of the run, whichever is first, never more than once per step.

    What they cost the loop: nothing per step but a compare. The loop calls :meth:`ProgressBar.update`
    only once ``timestamp.batch`` reaches ``due_batch`` or the clock reaches ``due_time`` (every step
    while a bar is drawn, for tqdm's count; otherwise when a line is due). Neither display reads the
    device per step: the loss shown is the ``train/loss`` that ``logger`` last wrote (the Trainer's one
    read per ``log_interval``, the rank average); when the Logger writes nowhere, rank 0's loss is read
    when a line is printed, or at a redraw of the bar at most once a second.

    Args:
        enabled: show anything at all (the Trainer enables it on rank 0 only, when ``progress_bar``).
        stream: where the bar is drawn (default ``sys.stderr``) when it is a terminal.
        logger: the :class:`kiln.loggers.Logger` whose last written values are shown (None: none).
        refresh_interval: the least seconds between two redraws of the bar (tqdm's ``mininterval``).
        console_interval: the most time between two step lines (see :func:`parse_console_interval`);
            ``None`` writes no lines.
        console_stream: where lines go when it is not a terminal (default: ``sys.stdout`` at each line).

    Example::

        trainer = kiln.Trainer(model, ..., console_interval="1m")  # in a SLURM log: a line a minute
    """

    def __init__(
        self,
        enabled: bool = True,
        stream: Any = None,
        logger: Logger | None = None,
        refresh_interval: float = 0.25,
        console_interval: Time | str | float | None = "30s",
        console_stream: Any = None,
    ) -> None:
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.logger = logger
        self.refresh_interval = refresh_interval
        self.console_interval = parse_console_interval(console_interval)
        self.console_stream = console_stream
        # The loop calls update() once timestamp.batch >= due_batch or perf_counter() >= due_time.
        self.due_batch: float = math.inf
        self.due_time: float = math.inf
        self._bar: Any = None
        self._bar_counter = "_batch"  # the Timestamp field the bar counts
        self._bar_read = -math.inf  # tqdm's clock at the bar's last read of the loss
        self._bar_loss: float | None = None
        # ((samples, tokens, training seconds), the rate then) at the bar's last redraw, and at the last line
        self._bar_window: tuple[tuple[int, int, float], tuple[str, float | None]] | None = None
        self._lines: Any = None  # the stream lines go to during fit() (None: no lines)
        self._line_window: tuple[tuple[int, int, float], tuple[str, float | None]] | None = None
        self._first_line = True
        self._start: dict[str, float] = {}  # where fit() started: clock, batch, counter, training seconds
        self._total_batches: int | None = None
        self._next_batch: float = math.inf  # when the next step line is due
        self._next_time: float = math.inf
        self._eval_started = 0.0

    # -- fit() --------------------------------------------------------------------------------------
    def start(self, state: Any) -> None:
        """fit() begins: draw the run's bar on a terminal, or get ready to write lines."""
        self.close()
        self.due_batch = self.due_time = math.inf
        if not self.enabled:
            return
        ts, duration = state.timestamp, state.max_duration
        now = time.perf_counter()
        self._total_batches = _total_batches(state)
        counter = _UNIT_FIELD.get(duration.unit, "_batch")
        self._start = {"clock": now, "batch": ts._batch, "counter": getattr(ts, counter), "wct": ts._total_wct}
        if _is_terminal(self.stream):
            self._draw_bar(state)
            self.due_batch = 0  # tqdm counts every step
        self._lines = self._line_stream()
        if self._lines is not None:
            self._first_line, self._line_window = True, None
            self.due_batch = min(self.due_batch, ts._batch + 1)  # the start line, after the first step

    def start_epoch(self, state: Any) -> None:
        if self._bar is not None:
            self._bar.set_description_str(_epoch_desc(state), refresh=False)

    def update(self, state: Any) -> None:
        """The loop's call when a step reached ``due_batch`` or ``due_time``."""
        if self._bar is not None:
            self._update_bar(state)
        if self._lines is not None:
            now, ts = time.perf_counter(), state.timestamp
            if self._first_line:
                self._first_line = False
                first = now - self._start["clock"]
                self._write(f"training started: first step done {first:.2f} s into fit(); {_to_go(state)}")
                self._throughput(ts, "_line_window")  # the rates of later lines leave the first step out
                self._schedule(state, now)
            elif ts._batch >= self._next_batch or now >= self._next_time:
                self._write(self._step_line(state))
                self._schedule(state, now)

    def finish(self, state: Any, checkpoint: Any = None) -> None:
        """fit() ended: the bar's last redraw, the summary line (with ``checkpoint``, the last saved)."""
        if self._bar is not None:
            self._bar.set_postfix(self._postfix(state, read=True), refresh=False)
        self.close()
        self.due_batch = self.due_time = math.inf
        if self._lines is None:
            return
        ts = state.timestamp
        wall = time.perf_counter() - self._start["clock"]
        what = f"stopped ({state.stop_reason})" if getattr(state, "_stop", False) else "done"
        training = _clock(ts._total_wct - self._start["wct"])
        parts = [f"{what}: {_position(state, self._total_batches)} in {_clock(wall)} ({training} training)"]
        loss = self._loss(state, read=True)
        if loss is not None:
            parts.append(f"loss {loss:.4g}")
        parts += [
            f"{key} {value:.4g}"
            for key, value in state.metrics.items()
            if key.startswith("eval") and isinstance(value, (int, float))
        ]
        line = ", ".join(parts)
        self._write(line + (f"; last checkpoint {checkpoint}" if checkpoint is not None else ""))
        self._lines = None

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    # -- evaluation (any time: fit() or Trainer.eval()) -----------------------------------------------
    def eval_start(self, state: Any, label: str, dataloader: Any, subset_num_batches: int | None) -> None:
        self._eval_started = time.perf_counter()
        stream = self._lines or self._line_stream()
        if stream is None:
            return
        try:
            batches: int | None = len(dataloader)
        except TypeError:
            batches = None
        if subset_num_batches is not None:
            batches = subset_num_batches if batches is None else min(batches, subset_num_batches)
        size = f" ({batches} batches)" if batches is not None else ""
        self._write(f"{label} starts at step {state.timestamp._batch}{size}", stream)

    def eval_end(self, label: str, results: dict[str, float]) -> None:
        stream = self._lines or self._line_stream()
        if stream is not None:
            values = "  ".join(f"{key} {value:.4g}" for key, value in results.items())
            self._write(f"{label} done in {time.perf_counter() - self._eval_started:.1f} s: {values}", stream)

    # -- the bar -------------------------------------------------------------------------------------
    def _draw_bar(self, state: Any) -> None:
        from tqdm.auto import tqdm

        duration, ts = state.max_duration, state.timestamp
        total: float | None = self._total_batches
        unit, self._bar_counter = "ba", "_batch"
        if duration.unit in (TimeUnit.SAMPLE, TimeUnit.TOKEN):
            unit, self._bar_counter, total = duration.unit.value, _UNIT_FIELD[duration.unit], duration.value
        self._bar_window, self._bar_read, self._bar_loss = None, -math.inf, None
        self._bar = tqdm(
            total=total,
            desc=_epoch_desc(state),
            file=self.stream,
            dynamic_ncols=True,
            initial=getattr(ts, self._bar_counter),
            unit=unit,
            leave=True,
            mininterval=self.refresh_interval,
        )

    def _update_bar(self, state: Any) -> None:
        bar = self._bar
        bar.update(getattr(state.timestamp, self._bar_counter) - bar.n)
        # tqdm redraws at most every mininterval: refresh what the next redraw shows only then
        # (the last redraw is finish()'s).
        if bar.last_print_n == bar.n:
            bar.set_postfix(self._postfix(state, read=bar.last_print_t - self._bar_read >= _READ_EVERY), refresh=False)

    def _postfix(self, state: Any, read: bool) -> dict[str, str]:
        postfix = {}
        if read:  # kept for the redraws until the next read
            self._bar_loss = self._loss(state, read=True)
            self._bar_read = self._bar.last_print_t if self._bar is not None else 0.0
        loss = self._logged("train/loss")
        if loss is None:
            loss = self._bar_loss
        if loss is not None:
            postfix["loss"] = f"{loss:.4g}"
        lr = self._lr(state)
        if lr is not None:
            postfix["lr"] = f"{lr:.3g}"
        unit, rate = self._throughput(state.timestamp, "_bar_window")
        if rate is not None:
            postfix[unit] = f"{rate:.3g}"
        eta = _eta(state)
        if eta is not None:
            postfix["eta"] = _clock(eta)
        return postfix

    # -- the lines -----------------------------------------------------------------------------------
    def _line_stream(self) -> Any:
        if not self.enabled or self.console_interval is None:
            return None
        stream = self.console_stream if self.console_stream is not None else sys.stdout
        return None if stream is None or _is_terminal(stream) else stream

    def _write(self, text: str, stream: Any = None) -> None:
        # flushed: stdout into a file or pipe is block-buffered, and a line is for reading now
        print(f"{time.strftime('%H:%M:%S')} {text}", file=stream or self._lines, flush=True)

    def _step_line(self, state: Any) -> str:
        parts = [_position(state, self._total_batches)]
        loss = self._loss(state, read=True)
        if loss is not None:
            parts.append(f"loss {loss:.4g}")
        lr = self._lr(state)
        if lr is not None:
            parts.append(f"lr {lr:.3g}")
        unit, rate = self._throughput(state.timestamp, "_line_window")
        if rate is not None:
            parts.append(f"{rate:.4g} {unit}")
        eta = _eta(state)
        if eta is not None:
            parts.append(f"eta {_clock(eta)}")
        return "  ".join(parts)

    def _schedule(self, state: Any, now: float) -> None:
        """When the next step line is due: after ``console_interval``, or at the next tenth of the run."""
        interval, ts = self.console_interval, state.timestamp
        assert interval is not None  # no lines are written without one
        self._next_time = now + interval.value if interval.unit == TimeUnit.SECOND else math.inf
        self._next_batch = ts._batch + int(interval.value) if interval.unit == TimeUnit.BATCH else math.inf
        tenth = self._next_tenth(state, now)
        if isinstance(tenth, tuple):  # a run in seconds: its tenths are times
            self._next_time = min(self._next_time, tenth[0])
        else:
            self._next_batch = min(self._next_batch, tenth)
        self.due_time = self._next_time
        self.due_batch = 0 if self._bar is not None else self._next_batch

    def _next_tenth(self, state: Any, now: float) -> float | tuple[float]:
        """The batch (or, for a run in seconds, the ``(time,)``) of the next tenth of this fit's run,
        up to the ninth: the summary line is the tenth."""
        ts, duration, start = state.timestamp, state.max_duration, self._start
        if self._total_batches is not None:
            span, done = self._total_batches - start["batch"], ts._batch - start["batch"]
            k = int(done * 10 // span) + 1 if span > 0 else 10
            batch = start["batch"] + math.ceil(k * span / 10)
            return batch if k < 10 and batch < self._total_batches else math.inf
        field = _UNIT_FIELD.get(duration.unit)
        if field is None:  # epochs of unknown length
            return math.inf
        span, done = duration.value - start["counter"], getattr(ts, field) - start["counter"]
        k = int(done * 10 // span) + 1 if span > 0 else 10
        if k >= 10:
            return math.inf
        left = k * span / 10 - done
        if duration.unit == TimeUnit.SECOND:
            return (now + left,)  # training seconds, as wall-clock seconds from now
        batches = ts._batch - start["batch"]
        return ts._batch + max(1, math.ceil(left * batches / done)) if done > 0 else ts._batch + 1

    # -- shared ----------------------------------------------------------------------------------------
    def _logged(self, key: str) -> Any:
        value = self.logger.latest.get(key) if self.logger is not None else None
        return value if isinstance(value, (int, float)) else None

    def _loss(self, state: Any, read: bool) -> float | None:
        """The loss the loggers last wrote; when no logger writes it, with ``read``, rank 0's loss
        read from the device (once per line or per second of redraws, never per step)."""
        loss = self._logged("train/loss")
        if loss is not None or not read or state.loss is None:
            return loss
        if self.logger is not None and self.logger.destinations:
            return None  # the loggers write it every log_interval: shown from the first one
        return float(state.loss.detach())

    def _lr(self, state: Any) -> float | None:
        lr = self._logged("train/lr")
        return lr if lr is not None else state.lr

    def _throughput(self, ts: Any, slot: str) -> tuple[str, float | None]:
        """Samples (tokens, when counted) per second of training since the last call for ``slot``
        (this epoch's at the first call; the last result again when no batch ran since)."""
        now = (ts._sample, ts._token, ts._total_wct)
        previous = getattr(self, slot)
        window = previous[0] if previous is not None else None
        if previous is not None and now[2] <= previous[0][2]:
            return previous[1]
        if window is None:
            seconds, samples, tokens = ts.epoch_wct, ts._sample_in_epoch, ts._token_in_epoch
        else:
            seconds, samples, tokens = now[2] - window[2], now[0] - window[0], now[1] - window[1]
        result: tuple[str, float | None] = ("sp/s", None)
        if seconds > 0:
            result = ("tok/s", tokens / seconds) if tokens else ("sp/s", samples / seconds)
        setattr(self, slot, (now, result))
        return result


_UNIT_FIELD = {
    TimeUnit.BATCH: "_batch",
    TimeUnit.SAMPLE: "_sample",
    TimeUnit.TOKEN: "_token",
    TimeUnit.SECOND: "_total_wct",
}


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _total_batches(state: Any) -> int | None:
    """The batch count at which the run ends: ``ba`` runs, and ``ep`` runs of a known epoch length."""
    duration, ts = state.max_duration, state.timestamp
    if duration.unit == TimeUnit.BATCH:
        return int(duration.value)
    if duration.unit == TimeUnit.EPOCH and state.dataloader_len:
        # the batches of the epochs so far, then whole epochs from this one's start
        return ts._batch - ts._batch_in_epoch + (int(duration.value) - ts._epoch) * state.dataloader_len
    return None


def _epoch_desc(state: Any) -> str:
    duration = state.max_duration
    if duration.unit != TimeUnit.EPOCH:
        return f"epoch {state.timestamp._epoch + 1}"
    return f"epoch {min(state.timestamp._epoch + 1, duration.value)}/{duration.value}"


def _position(state: Any, total_batches: int | None) -> str:
    """``step 48/200 (24%)``; in other units ``step 48, 6144/20000 sp (31%)``."""
    ts, duration = state.timestamp, state.max_duration
    if total_batches:
        text = f"step {ts._batch}/{total_batches} ({ts._batch / total_batches:.0%})"
        return text + (f", {_epoch_desc(state)}" if duration.unit == TimeUnit.EPOCH else "")
    field = _UNIT_FIELD.get(duration.unit)
    if field is None:  # epochs of unknown length
        return f"step {ts._batch}, {_epoch_desc(state)}"
    done = getattr(ts, field)
    if duration.unit == TimeUnit.SECOND:
        return f"step {ts._batch}, {_clock(done)}/{_clock(duration.value)} ({done / duration.value:.0%})"
    return f"step {ts._batch}, {done}/{duration.value} {duration.unit.value} ({done / duration.value:.0%})"


def _to_go(state: Any) -> str:
    total, duration = _total_batches(state), state.max_duration
    if total is not None:
        return f"{total - state.timestamp._batch} steps to go"
    return f"runs to {duration.value} {duration.unit.value}"


def _clock(seconds: float) -> str:
    """``02:05``, ``1:02:05``: tqdm's format for a duration (whole seconds, rounded down as tqdm does)."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def _eta(state: Any) -> float | None:
    """Seconds left in the run at the training speed so far (None: unknown)."""
    duration, ts = state.max_duration, state.timestamp
    if duration is None:
        return None
    elapsed, unit, total = ts.total_wct, duration.unit, duration.value
    if unit == TimeUnit.SECOND:
        return max(0.0, total - elapsed)
    if unit == TimeUnit.EPOCH:
        batches = state.dataloader_len
        if not batches:
            return None
        done = ts.epoch.value + ts.batch_in_epoch.value / batches
    elif unit == TimeUnit.BATCH:
        done = ts.batch.value
    elif unit == TimeUnit.SAMPLE:
        done = ts.sample.value
    elif unit == TimeUnit.TOKEN:
        done = ts.token.value
    else:
        return None
    if done <= 0 or elapsed <= 0:
        return None
    return elapsed * max(0.0, total - done) / done
