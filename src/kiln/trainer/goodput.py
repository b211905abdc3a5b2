"""`GoodputMonitor`: where a run's wall time goes, kept across its launches (issue 35).

The Trainer adds one by default (``Trainer(goodput=False)`` leaves it out). It splits each
launch's wall time into the segments of :mod:`kiln.report.goodput` by charging the time since its
last mark to the segment the loop is in, at a few events:

* ``AFTER_DATALOADER``: the time since the last step ended was the wait for this batch (data);
* ``BATCH_CHECKPOINT`` / ``EPOCH_CHECKPOINT`` / ``FIT_END``: a companion registered just before
  the checkpoint saver marks the end of the step's work (productive), and the monitor, after the
  saver, charges the saver's time (checkpoint stall, whatever the saver did: a blocking save, the
  wait for an async one, retention); the first step's end closes ``starting`` (or ``recovery``);
* ``EVAL_START`` / ``EVAL_END``: evaluation inside ``fit()``.

Every interval of the launch goes to exactly one segment, so a launch's segments add up to its
wall time (from the process's start, or from the failure it recovers from, to its last record).
Per step this is two or three ``perf_counter`` reads and additions: no device read, no collective,
no I/O. Every ``interval`` seconds (checked at a step's end), at ``FIT_END`` and at the process's
exit (an error, a preemption), rank 0 writes the account atomically to ``goodput.json`` in the save
folder (``<save_folder>.goodput.json``, beside it: the folder holds checkpoints only; else beside a
File logger's file): a SIGKILL loses at most its last ``interval`` seconds. Every ``log_interval``
seconds, and at ``FIT_END`` once it has logged, it logs ``goodput/fraction``, ``goodput/lost_steps``
and ``goodput/seconds/<segment>`` (the run's totals over all launches). The Trainer adds it only
when there is a save folder or a logger (somewhere for the account to go).

A launch that resumes reads the account: when the last launch did not reach the end of ``fit()``
(it failed), its time after the checkpoint resumed from becomes lost work and its steps past it
lost steps (:func:`kiln.report.goodput.fold_failure`), and this launch starts with ``recovery``
from that launch's last record. After a launch that ended, the time between the two is not counted.

Args:
    interval: seconds between two writes of the account file.
    log_interval: seconds between two logs of the ``goodput/*`` metrics (a record of a dozen
        values; a run shorter than this logs none: its account is in the file).
    start: Unix time the first launch's ``starting`` counts from (default: the process's start).

Example::

    trainer = kiln.Trainer(model, ..., save_folder="runs/a/ckpt")     # runs/a/ckpt.goodput.json
    trainer = kiln.Trainer(model, ..., goodput=GoodputMonitor(interval=10.0))
"""

from __future__ import annotations

import atexit
import os
import re
import time
from pathlib import Path
from typing import Any

from kiln.core.callback import Callback
from kiln.core.state import State
from kiln.report.goodput import ACCOUNT_NAME, POINTER_ENV, fold_failure, fraction, new_launch, read_account, totals
from kiln.report.goodput import write_account as _write

__all__ = ["GoodputMonitor", "process_start_time"]

_KEEP_COMMITS = 16  # a resume goes back to one of the newest checkpoints


def process_start_time() -> float:
    """This process's start as a Unix time (Linux's /proc; elsewhere: now)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rpartition(")")[2].split()
        with open("/proc/stat", encoding="ascii") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + float(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class _SaveStart(Callback):
    """Registered just before the checkpoint saver: what ran since the last mark was the step's."""

    def __init__(self, monitor: GoodputMonitor) -> None:
        self.monitor = monitor

    def batch_checkpoint(self, state: State, logger: Any) -> None:
        self.monitor._into("checkpoint")

    def epoch_checkpoint(self, state: State, logger: Any) -> None:
        self.monitor._into("checkpoint")

    def fit_end(self, state: State, logger: Any) -> None:
        self.monitor._into("checkpoint")


class GoodputMonitor(Callback):
    __doc__ = __doc__

    def __init__(self, interval: float = 2.0, log_interval: float = 30.0, start: float | None = None) -> None:
        for name, value in (("interval", interval), ("log_interval", log_interval)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"GoodputMonitor {name}={value!r} must be a number of seconds >= 0")
        self.interval, self.log_interval = float(interval), float(log_interval)
        self._log_due = 0.0
        self._logged = False  # goodput/* logged in this process
        self.start = process_start_time() if start is None else float(start)
        self.save_timer = _SaveStart(self)
        self.path: Path | None = None  # the account's file (rank 0), set by attach()
        self.launches: list[dict[str, Any]] = []  # the earlier launches, then this one
        self.launch: dict[str, Any] | None = None
        self.seconds: dict[str, float] = {}
        self._current = "starting"
        self._mark = 0.0
        self._due = 0.0
        self._fitting = False
        self._saver: Any = None
        self._last_path: Any = None
        self._state: State | None = None

    def attach(self, saver: Any, destinations: Any) -> None:
        """Where the account lives: the saver's local folder, else beside the first local File logger's file."""
        self._saver = saver
        folder = getattr(saver, "folder", None)
        if isinstance(folder, Path):  # beside the folder: the folder holds checkpoints only
            self.path = folder.parent / f"{folder.name}.{ACCOUNT_NAME}"
            return
        for destination in destinations:
            path = getattr(destination, "path", None)
            if isinstance(path, Path) and type(destination).__name__ == "FileLogger":
                self.path = path.with_name(f"{path.stem}.{ACCOUNT_NAME}")
                return

    # -- the marks -----------------------------------------------------------------------------
    def _charge(self) -> float:
        now = time.perf_counter()
        self.seconds[self._current] += now - self._mark
        self._mark = now
        return now

    def _into(self, segment: str) -> None:
        if self._fitting:
            self._charge()
            self._current = segment

    def after_dataloader(self, state: State, logger: Any) -> None:
        if self._current == "data":  # else starting/recovery: the first step's fetch is the launch's start
            self._charge()
            self._current = "productive"

    def _step_done(self, state: State, logger: Any) -> None:
        if not self._fitting:
            return
        now = self._charge()
        self._current = "data"
        saver = self._saver
        if saver is not None and saver.last_path is not self._last_path:  # a checkpoint committed
            self._last_path = saver.last_path
            self._commit(state)
        if now >= self._due:
            self.record(state, logger)

    batch_checkpoint = _step_done
    epoch_checkpoint = _step_done

    def eval_start(self, state: State, logger: Any) -> None:
        if self._fitting:
            self._charge()
            self._resume_to, self._current = self._current, "eval"

    def eval_end(self, state: State, logger: Any) -> None:
        if self._fitting and self._current == "eval":
            self._charge()
            self._current = self._resume_to

    # -- the launch ----------------------------------------------------------------------------
    def fit_start(self, state: State, logger: Any) -> None:
        self._state = state
        step = state.timestamp.batch.value
        if self.launch is not None:  # fit() again in this process: the time between counts as starting
            first = "starting"
        else:
            begin, first = self.start, "starting"
            launches = read_account(self.path) if self.path is not None and state.rank == 0 and step > 0 else []
            if fold_failure(launches, step):
                begin, first = float(launches[-1]["end"]), "recovery"
            self.launch = new_launch(begin, step, state.world_size)
            self.launches = [*launches, self.launch]
            self.seconds = self.launch["seconds"]
            # the launch's clock on perf_counter's axis: the time since `begin` is charged at the first mark
            self._mark = time.perf_counter() - (time.time() - begin)
        self.launch["ended"] = False
        self._current = first
        self._fitting = True
        self._last_path = getattr(self._saver, "last_path", None)
        self._due = time.perf_counter() + self.interval
        self._log_due = time.perf_counter() + self.log_interval
        if state.rank == 0 and self.path is not None:
            atexit.register(self._at_exit)
            pointer = os.environ.get(POINTER_ENV)
            if pointer:
                try:
                    Path(pointer).write_text(str(self.path.resolve()), encoding="utf-8")
                except OSError:
                    pass  # only kiln run's last line reads it

    def fit_end(self, state: State, logger: Any) -> None:
        if not self._fitting:
            return
        self._charge()
        self._current = "data"
        saver = self._saver
        if saver is not None and saver.last_path is not self._last_path:
            self._last_path = saver.last_path
            self._commit(state)
        assert self.launch is not None
        self.launch["ended"] = True
        if self._logged:  # the series gets its last point; a run shorter than log_interval logs none
            self._log_due = 0.0
        self._logged = False  # goodput/* logged in this process
        self.record(state, logger)
        self._fitting = False
        atexit.unregister(self._at_exit)

    def _commit(self, state: State) -> None:
        """The segments when the checkpoint of this step (the saver's last path) committed."""
        assert self.launch is not None
        name = getattr(self._last_path, "name", "")
        found = re.search(r"ba(\d+)", str(name))
        step = int(found.group(1)) if found else state.timestamp.batch.value
        commits = self.launch["commits"]
        commits.append({"step": step, "seconds": dict(self.seconds)})
        del commits[:-_KEEP_COMMITS]

    def record(self, state: State, logger: Any = None) -> None:
        """Rank 0: write the account now, and log the run's totals when ``log_interval`` has passed."""
        if state.rank != 0 or self.launch is None:
            return
        now = time.perf_counter()
        self._due = now + self.interval
        self.launch["end"] = time.time()
        self.launch["last_step"] = state.timestamp.batch.value
        if self._fitting:  # the interval since the last mark, charged where it belongs
            self._charge()
        if logger is not None and now >= self._log_due:
            self._log_due, self._logged = now + self.log_interval, True
            sums = totals(self.launches)
            value = fraction(self.launches)
            if value > 0:
                metrics: dict[str, Any] = {f"goodput/seconds/{k}": v for k, v in sums.items()}
                metrics["goodput/fraction"] = value
                metrics["goodput/lost_steps"] = sum(int(x.get("lost_steps", 0)) for x in self.launches)
                logger.log_metrics(metrics, step=state.timestamp.batch.value)
        if self.path is not None:
            try:
                _write(self.path, self.launches)
            except OSError:
                pass  # a full disk must not stop training; the next write tries again

    def _at_exit(self) -> None:
        if self._fitting and self._state is not None:
            self.record(self._state)
