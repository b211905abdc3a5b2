"""Which rank did not arrive: a heartbeat per rank in the c10d store, read when a collective times out.

When one rank stops (a hang in data loading, a deadlock in user code, a dead node), the others wait in
their next collective until the process-group timeout and then fail with gloo's "Timed out waiting
20000ms for recv operation to complete", which names neither the rank they waited for nor where it
was. So every rank of a launched world (``kiln.launch*``, more than one process) keeps its last kiln
event in the store the process group was made with, under ``kiln/heartbeat/<rank>``, and a rank
whose collective times out reads them all and raises (or, outside the Trainer, prints) one line::

    kiln: rank 1 did not arrive within 20 s; last events: rank 0 BEFORE_BACKWARD (batch 5), rank 1 BATCH_START (batch 5)

In a job of several nodes each rank's heartbeat also carries its node (as the launcher numbers
it: torchrun's ``GROUP_RANK``, SLURM's ``SLURM_NODEID``) and host, and the line names them for
the ranks that did not arrive: ``kiln: rank 3 (node 1, host gpu07) did not arrive within 20 s;
...``, so the machine to look at is in the message.

Cost. The training thread only notes its event in a Python attribute (the Trainer's
:class:`~kiln.trainer.events.EventRunner` does it on every event when a heartbeat runs). A daemon
thread publishes it, when it changed, every ``min(1 s, timeout / 10)``: one store ``set`` (a few
microseconds, no reply awaited) per second per rank, on a clone of the store so it never waits on
the process group's use of it. Publishing from a thread is what lets a rank that is stuck (asleep,
in a C call that released the GIL, in a busy Python loop) still be described by its last event.

Who did not arrive. A rank that times out marks its own heartbeat "waiting"; the ranks without the
mark did not arrive. In a world of two that is the other rank at once; in a larger one the ranks
that are also waiting time out at about the same moment (they entered the same collective), so the
reporting rank waits for their marks up to ``min(5 s, timeout / 4)``.

NCCL: its watchdog aborts the process on a timeout before Python sees an exception (torch's flight
recorder, ``TORCH_NCCL_TRACE_BUFFER_SIZE``, is the tool there); the heartbeats are still in the
store. gloo raises in the calling thread, which is where this module reports.
"""

from __future__ import annotations

import atexit
import json
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = ["CollectiveTimeout", "Heartbeat", "current", "follow", "is_timeout", "raise_if_timed_out", "start", "stop"]

_KEY = "kiln/heartbeat/{}"
# gloo: "[.../third_party/gloo/...] Timed out waiting 20000ms for recv operation to complete"; c10d's own
# errors (store waits, barriers) are DistErrors that say "timeout"
_TIMEOUT_TEXT = re.compile(r"timed out|timeout", re.IGNORECASE)


class CollectiveTimeout(RuntimeError):
    """A collective (or store wait) timed out because ranks did not arrive.

    Attributes:
        missing: the ranks that did not arrive (empty when every rank was waiting).
        events: each rank's last kiln event, as text.
    """

    def __init__(self, message: str, missing: list[int], events: dict[int, str]) -> None:
        super().__init__(message)
        self.missing, self.events = missing, events


class Heartbeat:
    """This rank's last kiln event, published to the c10d store by a daemon thread.

    Args:
        store: the store the process group was made with (a clone is used from the thread).
        rank, world_size: this process's place.
        timeout: the process-group timeout, in seconds.
        node, num_nodes: this process's node and the job's number of nodes; by default from the
            launcher's variables (:func:`kiln.launch.environments.node_of`).
        host: this machine's name (default ``socket.gethostname()``).
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        timeout: float,
        node: int | None = None,
        num_nodes: int | None = None,
        host: str | None = None,
    ) -> None:
        from kiln.launch.environments import node_of

        self.store, self.rank, self.world_size, self.timeout = store, rank, world_size, timeout
        found_node, found_num_nodes = node_of()
        self.node = found_node if node is None else node
        self.num_nodes = found_num_nodes if num_nodes is None else num_nodes
        self.host = socket.gethostname() if host is None else host
        # What this rank is doing, in words; the Trainer points it at its event runner.
        self.where: Callable[[], str] | None = None
        self.interval = min(1.0, timeout / 10)
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._published: str | None = None

    def start(self) -> None:
        self._publish(self.store)  # the key exists from launch on: readers never wait for it
        store = self.store.clone()  # type: ignore[attr-defined]  # torch's stubs lack Store.clone
        self._thread = threading.Thread(target=self._run, args=(store,), name="kiln-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop publishing (before interpreter shutdown: a thread inside a store call then could abort it)."""
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval + 1)
        self._thread = None

    def _run(self, store: dist.Store) -> None:
        while not self._stopped.wait(self.interval):
            try:
                self._publish(store)
            except Exception:  # noqa: BLE001 - the store went away (the job is ending): stop quietly
                return

    def _describe(self) -> str:
        where = self.where
        if where is None:
            return "no kiln event yet"
        try:
            return where()
        except Exception:  # noqa: BLE001 - read from another thread while the loop moves on
            return "unknown"

    def _publish(self, store: dist.Store, waiting: bool = False) -> None:
        value = json.dumps({"where": self._describe(), "waiting": waiting, "node": self.node, "host": self.host})
        if value != self._published:
            store.set(_KEY.format(self.rank), value)
            self._published = value

    def _read(self) -> dict[int, dict[str, Any]]:
        beats = {}
        for rank in range(self.world_size):
            key = _KEY.format(rank)
            try:
                if self.store.check([key]):
                    beats[rank] = json.loads(self.store.get(key))
            except Exception:  # noqa: BLE001 - an unreachable store leaves the rank undescribed
                pass
        return beats

    def timed_out(self) -> CollectiveTimeout:
        """The error for a collective of this rank that timed out: who did not arrive, and where each rank was."""
        self.stop()  # from here on this thread writes the key: the publisher must not overwrite the mark
        try:
            self._publish(self.store, waiting=True)
        except Exception:  # noqa: BLE001 - the store may be gone with the rank that hosted it
            pass
        others = [r for r in range(self.world_size) if r != self.rank]
        grace = 0.0 if self.world_size == 2 else min(5.0, self.timeout / 4)
        deadline = time.monotonic() + grace
        while True:
            beats = self._read()
            missing = [r for r in others if not beats.get(r, {}).get("waiting")]
            if not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        events = {r: beats[r]["where"] if r in beats else "no heartbeat" for r in range(self.world_size)}
        listed = ", ".join(f"rank {r} {events[r]}" for r in range(self.world_size))
        seconds = f"{self.timeout:g} s"
        if missing:
            named = [f"{r}{self._place(beats.get(r, {}))}" for r in missing]
            who = f"rank {named[0]}" if len(named) == 1 else "ranks " + ", ".join(named)
            message = f"kiln: {who} did not arrive within {seconds}; last events: {listed}"
        else:
            message = f"kiln: a collective timed out after {seconds} with every rank waiting; last events: {listed}"
        return CollectiveTimeout(message, missing, events)

    def _place(self, beat: dict[str, Any]) -> str:
        """`` (node N, host H)`` for a rank's heartbeat in a job of several nodes, else nothing."""
        if not (self.num_nodes or 0) > 1 or "host" not in beat:
            return ""  # one node: the rank number says it all; no heartbeat: nothing known
        node = beat.get("node")
        return f" (node {node if node is not None else '?'}, host {beat['host']})"


_CURRENT: Heartbeat | None = None
_hooked = False


def current() -> Heartbeat | None:
    """The running heartbeat (None in a world of one, or when the group was not made by kiln)."""
    return _CURRENT


def start(store: dist.Store, rank: int, world_size: int, timeout: float) -> Heartbeat:
    """Start this rank's heartbeat (kiln's launchers call this after making the process group)."""
    global _CURRENT, _hooked
    stop()
    _CURRENT = Heartbeat(store, rank, world_size, timeout)
    _CURRENT.start()
    if not _hooked:
        atexit.register(stop)  # registered after kiln's teardown, so it runs first
        sys.excepthook = _excepthook_over(sys.excepthook)
        _hooked = True
    return _CURRENT


def stop() -> None:
    global _CURRENT
    if _CURRENT is not None:
        _CURRENT.stop()
        _CURRENT = None


def follow(where: Callable[[], str], replace: bool = True) -> None:
    """Describe this rank by ``where()`` from now on (the Trainer's current event, as text);
    ``replace=False``: only if nothing describes it yet (an Engine, which a Trainer may drive)."""
    if _CURRENT is not None and (replace or _CURRENT.where is None):
        _CURRENT.where = where


def is_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective or store timeout (and not yet explained)."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, CollectiveTimeout):
        return False
    text = str(exc)
    # A DistBackendError raised inside backward reaches Python as a plain RuntimeError: gloo's text tells.
    from_c10d = isinstance(exc, dist.DistError) or "gloo" in text
    return from_c10d and bool(_TIMEOUT_TEXT.search(text))


def raise_if_timed_out(exc: BaseException) -> None:
    """Raise :class:`CollectiveTimeout` from ``exc`` when it is a timeout and a heartbeat runs; else return."""
    if _CURRENT is not None and is_timeout(exc):
        raise _CURRENT.timed_out() from exc


def _excepthook_over(previous: Callable[..., Any]) -> Callable[..., Any]:
    """A timeout that escapes user code (an Engine loop) still gets its one line, before the traceback."""

    def excepthook(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        if _CURRENT is not None and is_timeout(value):
            try:
                print(_CURRENT.timed_out(), file=sys.stderr, flush=True)
            except Exception:  # noqa: BLE001 - the report must never hide the original error
                pass
        previous(kind, value, traceback)

    return excepthook
