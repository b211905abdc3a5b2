"""One run per save folder (or log file): a lock that names the run writing it.

Two processes that are not one job must never write the same checkpoint folder or log file
silently: their checkpoints interleave, retention deletes the other run's, ``last`` flips between
them, and the metrics file holds two histories that ``kiln report`` plots as one. The process that
writes (rank 0 of a job) holds a lock file, ``<save_folder>/.kiln-lock`` or ``.<name>.kiln-lock``
beside a log file, recording ``host``, ``pid``, ``run_id`` and ``since``. Another process that
finds it decides:

* **the same run id**: the same job (a second Trainer in it, or torchrun's restarted attempt; the
  run id is the launcher's job id, see :func:`run_id`), so the lock is its own;
* **this host, and the pid is gone** (or a zombie, or reused by a later process, or the machine
  rebooted since): a stale lock, left by a run killed with SIGKILL; taken over, with a warning;
* **otherwise** (this host and alive, or another host, whose processes cannot be checked from
  here): refused with :class:`FolderInUseError`, one line naming the holder's host, pid and run
  id and the lock file to delete if that run is gone.

The lock is released when the run ends (the end of ``fit``, ``close()``, the interpreter's exit);
only a run killed outright leaves it behind, and the next run on the same host takes it over.

Object stores (``s3://``, ``gs://``, ``memory://`` and other fsspec URLs) get no lock, on purpose:
fsspec has no create-if-absent that every store honours, so two runs starting together could
both "win", and a pid on another machine cannot be checked, so a crashed run's lock would block
every later run until someone deleted it by hand.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import time
import uuid
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kiln.core.warn import KilnWarning
from kiln.launch.environments import job_id

__all__ = ["FolderInUseError", "RunLock", "lock_path_for_file", "run_id", "LOCK_NAME"]

LOCK_NAME = ".kiln-lock"
# A lock file with no readable record yet is being written by the process that just created it;
# past this age it was left by a process that died between creating and writing it.
_HALF_WRITTEN_SECONDS = 5.0
_ATTEMPTS = 8


class FolderInUseError(RuntimeError):
    """A save folder or log file is held by another live run; the message is one line naming it."""


_RUN_IDS: dict[int, str] = {}


def run_id() -> str:
    """This process's run: the launcher's job id (the same on every rank and across torchrun's
    restarts), else an id of this process alone (a new one after ``fork``)."""
    pid = os.getpid()
    if pid not in _RUN_IDS:
        _RUN_IDS[pid] = job_id() or f"process:{uuid.uuid4().hex[:12]}"
    return _RUN_IDS[pid]


def lock_path_for_file(path: str | os.PathLike[str]) -> Path:
    """The lock of a single file (a log): ``.<name>.kiln-lock`` in the same folder."""
    path = Path(path)
    return path.with_name(f".{path.name}{LOCK_NAME}")


def _read_first_line(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.readline().strip() or None
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot, /proc/<pid>/stat field 22), to tell a reused pid."""
    stat = _read_first_line(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # the command name, in parentheses, may hold spaces
    return int(fields[19]) if len(fields) > 19 else None


def _this_process() -> dict[str, Any]:
    pid = os.getpid()
    try:
        pid_namespace: str | None = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_namespace = None
    return {
        "host": socket.gethostname(),
        "pid": pid,
        "run_id": run_id(),
        "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        # Only to judge a lock on this host: the same boot, the same pid namespace, the same process.
        "boot_id": _read_first_line("/proc/sys/kernel/random/boot_id"),
        "pid_namespace": pid_namespace,
        "start_ticks": _start_ticks(pid),
    }


def _is_stale(holder: dict[str, Any], me: dict[str, Any]) -> bool:
    """Whether ``holder`` (a lock record written on this host) belongs to a process that has ended."""
    if holder.get("boot_id") and me["boot_id"] and holder["boot_id"] != me["boot_id"]:
        return True  # the machine rebooted since: every process of then is gone
    if holder.get("pid_namespace") and me["pid_namespace"] and holder["pid_namespace"] != me["pid_namespace"]:
        return False  # another container's pids: not checkable from here, so assumed alive
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        pass
    stat = _read_first_line(f"/proc/{pid}/stat")
    if stat is not None and stat.rsplit(")", 1)[-1].split()[:1] == ["Z"]:
        return True  # exited, not yet reaped by its parent
    started = holder.get("start_ticks")
    return started is not None and _start_ticks(pid) not in (None, started)  # the pid was reused


_HELD: set[RunLock] = set()


def _release_all() -> None:
    for lock in list(_HELD):
        lock.release()


atexit.register(_release_all)


class RunLock:
    """The lock of one save folder or log file (a local path).

    Args:
        lock_file: where the lock lives (``folder / LOCK_NAME``, or :func:`lock_path_for_file`).
        key: the argument that named the guarded path, for messages (``"save_folder"``).
        guarded: the guarded folder or file, as the user gave it, for messages.
    """

    def __init__(self, lock_file: str | os.PathLike[str], key: str, guarded: Any) -> None:
        self.path = Path(lock_file)
        self.key = key
        self.guarded = guarded
        self.held = False

    # -- asking -------------------------------------------------------------------------------
    def conflict(self) -> str | None:
        """The one-line refusal if another live run holds the lock now, else None. Writes nothing."""
        holder = self._read()
        if holder is None:
            return None
        verdict = self._judge(holder, _this_process())
        return self._message(holder) if verdict in ("live", "elsewhere") else None

    # -- taking and giving back ---------------------------------------------------------------
    def acquire(self) -> None:
        """Hold the lock, or raise :class:`FolderInUseError` naming the live run that holds it."""
        if self.held:
            return
        me = _this_process()
        for _ in range(_ATTEMPTS):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                fd = -1
            if fd >= 0:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(json.dumps(me) + "\n")
                self._hold()
                return
            holder = self._read()
            if holder is None:
                if self._age() < _HALF_WRITTEN_SECONDS:
                    time.sleep(0.05)  # its creator is writing it now
                else:
                    self._take_over(None)
                continue
            verdict = self._judge(holder, me)
            if verdict == "ours":
                elsewhere = holder.get("host") != me["host"]
                if (elsewhere or holder.get("pid") != me["pid"]) and (elsewhere or _is_stale(holder, me)):
                    self._replace(me)  # this job's earlier attempt (a restart): record who holds it now
                self._hold()
                return
            if verdict != "stale":
                raise FolderInUseError(self._message(holder))
            warnings.warn(
                f"{self.key} {self.guarded}: taking over the lock {self.path} of run {holder.get('run_id')} "
                f"(pid {holder.get('pid')} on this host has ended without releasing it)",
                KilnWarning,
                stacklevel=2,
            )
            self._take_over(holder)
        raise FolderInUseError(
            f"{self.key} {self.guarded}: the lock {self.path} changed {_ATTEMPTS} times while this run "
            "tried to take it; another run is starting on the same path: give each run its own"
        )

    def release(self) -> None:
        """Give the lock back (only if the record is still this process's: a takeover is left alone)."""
        if not self.held:
            return
        self.held = False
        _HELD.discard(self)
        holder = self._read()
        me = _this_process()
        if holder is not None and (holder.get("host"), holder.get("pid")) == (me["host"], me["pid"]):
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    # -- helpers ------------------------------------------------------------------------------
    def _hold(self) -> None:
        self.held = True
        _HELD.add(self)

    def _read(self) -> dict[str, Any] | None:
        try:
            record = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def _age(self) -> float:
        try:
            return time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return 0.0

    @staticmethod
    def _judge(holder: dict[str, Any], me: dict[str, Any]) -> str:
        if holder.get("run_id") == me["run_id"]:
            return "ours"
        if holder.get("host") != me["host"]:
            return "elsewhere"
        return "stale" if _is_stale(holder, me) else "live"

    def _message(self, holder: dict[str, Any]) -> str:
        elsewhere = holder.get("host") != socket.gethostname()
        return (
            f"{self.key} {self.guarded} is in use by another run (host {holder.get('host')}, pid "
            f"{holder.get('pid')}, run id {holder.get('run_id')}, since {holder.get('since')}"
            + ("; on another host, so kiln cannot check that it still runs" if elsewhere else "")
            + f"): two runs writing one {self.key} mix their histories. Give this run another "
            f"{self.key}, or stop that run; if it is gone, delete {self.path}"
        )

    def _replace(self, me: dict[str, Any]) -> None:
        """Rewrite the record as this process's, atomically (readers never see half of it)."""
        tmp = self.path.with_name(f"{self.path.name}.{me['pid']}.{uuid.uuid4().hex[:8]}")
        tmp.write_text(json.dumps(me) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)

    def _take_over(self, judged: dict[str, Any] | None) -> None:
        """Remove the stale lock ``judged``, unless another run replaced it since it was read."""
        aside = self.path.with_name(f"{self.path.name}.stale-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another run removed it first
        try:
            moved: dict[str, Any] | None = json.loads(aside.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            moved = None
        if moved != judged:  # a run that took it over between the read and the rename: give it back
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass  # a third run already holds a newer one
        aside.unlink(missing_ok=True)
