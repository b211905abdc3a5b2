"""Nothing logged is lost to a crash: what destinations buffer reaches its file within seconds.

A destination that buffers (a file, TensorBoard's writer, stdout when it is not a terminal) loses
its buffer with its process. Each way a process ends is covered here or by the loop:

- **SIGKILL** (the OOM killer, a launcher's last resort, a node going away): nothing can run then,
  so a timer does the work beforehand. A destination calls :func:`mark` after each write; the
  first write after a flush arms a deadline ``flush_secs`` later, and one background thread per
  process flushes each destination when its deadline passes. A SIGKILL therefore loses at most
  the last ``flush_secs`` seconds. The per-write cost is one dict lookup (a lock and a clock read
  only on the first write after a flush); nothing is fsynced.
- **SIGTERM** (a launcher stopping the ranks after a peer failed, ``kill``, ``scancel``,
  Kubernetes): where SIGTERM would end the process as it stands (its default disposition), a
  handler is installed (from the main thread, when a destination opens and whenever a deadline is
  armed) that closes every open destination of this process (their buffers written, W&B's run
  finished) and then ends the process by SIGTERM as it would have ended. A handler someone else
  installed (kiln's preemption handler during ``fit``, the user's) is left in charge: it stops
  the run gracefully, and the exception path below flushes.
- **An exception** (in the loop, or a failed collective after a peer's death): the Trainer flushes
  its loggers on the way out; the interpreter's exit (``atexit``) flushes every destination still
  open.

A forked child (a DataLoader worker) starts with no destinations: the buffers it inherited are its
parent's to write.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import time
import warnings
import weakref
from typing import TYPE_CHECKING, Any

from kiln.core.warn import KilnWarning

if TYPE_CHECKING:
    from kiln.loggers.destination import LoggerDestination

__all__ = ["DEFAULT_FLUSH_SECS", "check_flush_secs", "mark", "watch", "unwatch", "flush_all", "close_all"]

DEFAULT_FLUSH_SECS = 2.0
"""Seconds a record may wait in a buffer (what a SIGKILL can lose): a flush syscall every 2 s costs nothing."""


def check_flush_secs(owner: str, flush_secs: Any) -> float:
    """``flush_secs`` as a float, or a ValueError naming ``owner`` and the value."""
    if isinstance(flush_secs, bool) or not isinstance(flush_secs, (int, float)) or not flush_secs > 0:
        raise ValueError(f"{owner} flush_secs must be a number of seconds > 0, got {flush_secs!r}")
    return float(flush_secs)


class _Flusher:
    """The process's open destinations, their flush deadlines and the thread that keeps them."""

    def __init__(self) -> None:
        self.open: weakref.WeakSet[LoggerDestination] = weakref.WeakSet()
        self.due: dict[int, tuple[float, LoggerDestination]] = {}  # id -> (deadline, destination)
        self.wake = threading.Condition()
        self.thread: threading.Thread | None = None
        self.warned = False

    def start(self) -> None:
        if self.thread is None or not self.thread.is_alive():
            # A daemon: it must never keep a finished process alive; the exit paths flush instead.
            self.thread = threading.Thread(target=self.run, name="kiln-logger-flush", daemon=True)
            self.thread.start()

    def run(self) -> None:
        while True:
            with self.wake:
                while True:
                    now = time.monotonic()
                    if self.due:
                        first = min(deadline for deadline, _ in self.due.values())
                        if first <= now:
                            break
                        self.wake.wait(first - now)
                    else:
                        self.wake.wait()
                ready = [key for key, (deadline, _) in self.due.items() if deadline <= now]
                destinations = [self.due.pop(key)[1] for key in ready]
            for destination in destinations:  # outside the lock: an upload may take a while
                self.flush(destination)

    def flush(self, destination: LoggerDestination) -> None:
        try:
            destination.flush()
        except Exception as exc:  # noqa: BLE001 - a full disk must not stop training; said once
            if not self.warned:
                self.warned = True
                warnings.warn(
                    f"{type(destination).__name__} could not flush its records ({type(exc).__name__}: {exc}); "
                    "they stay buffered and are retried at the next flush",
                    KilnWarning,
                    stacklevel=1,
                )


_flusher = _Flusher()


def mark(destination: LoggerDestination) -> None:
    """Call after each write: ``destination`` is flushed within its ``flush_secs`` from now at the latest."""
    due = _flusher.due
    if id(destination) in due:  # the hot path: a deadline no later than this record's is armed
        return
    deadline = time.monotonic() + getattr(destination, "flush_secs", DEFAULT_FLUSH_SECS)
    with _flusher.wake:
        due.setdefault(id(destination), (deadline, destination))
        _flusher.wake.notify()
    _flusher.start()
    _install_sigterm()  # again: a handler installed meanwhile may have put the default back


def watch(destination: LoggerDestination) -> None:
    """``destination`` has opened a file or run: flush it when the process ends (exit, SIGTERM)."""
    _flusher.open.add(destination)
    _install_sigterm()


def unwatch(destination: LoggerDestination) -> None:
    """``destination`` is closed: nothing left to flush."""
    _flusher.open.discard(destination)
    with _flusher.wake:
        _flusher.due.pop(id(destination), None)


def flush_all() -> None:
    """Flush every open destination of this process (each failure said once, none raised)."""
    for destination in list(_flusher.open):
        _flusher.flush(destination)


def close_all() -> None:
    """Close every open destination of this process (the process is ending)."""
    for destination in list(_flusher.open):
        try:
            destination.close()
        except Exception:  # noqa: BLE001 - the others still get closed; the process is ending anyway
            _flusher.flush(destination)


def _install_sigterm() -> None:
    """Make SIGTERM close the destinations first, where it would end the process as it stands."""
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers; the next arming from it does
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):  # not the main interpreter
        pass


def _on_sigterm(signum: int, frame: Any) -> None:
    # The process ends now, as SIGTERM would have ended it (launchers read the signal), once the
    # destinations have written what they hold.
    close_all()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _at_exit() -> None:
    flush_all()


def _forget_in_child() -> None:
    # A forked child (a DataLoader worker) inherits the parent's destinations and buffers; writing
    # them here would duplicate the parent's records. Its SIGTERM does what it did before kiln's.
    global _flusher
    _flusher = _Flusher()
    try:
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except (ValueError, OSError):  # forked from a thread other than the main one
        pass


atexit.register(_at_exit)
os.register_at_fork(after_in_child=_forget_in_child)
