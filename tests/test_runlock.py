"""One run per save folder or log file (kiln.launch.runlock): a second live run is refused with one
line naming host, pid and run id; a stale lock is taken over; the lock is given back at the end
(fit end, close, exit); a job does not conflict with itself; object stores are not locked."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import kiln
from distributed import base_env
from kiln.checkpoint import CheckpointSaver
from kiln.launch import runlock
from kiln.launch.runlock import LOCK_NAME, FolderInUseError, RunLock, lock_path_for_file
from kiln.loggers import FileLogger
from workers.ckpt_common import build_state, train

HOLDER = """
import sys
from kiln.launch.runlock import RunLock, run_id
lock = RunLock(sys.argv[1], "save_folder", "x")
lock.acquire()
print("held", run_id(), flush=True)
sys.stdin.readline()  # hold until the test says so
if sys.argv[2] == "release":
    lock.release()
"""


class Holder:
    """Another live process holding the lock at ``path`` until it is told to end."""

    def __init__(self, path, end="exit"):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(path), end],
            env=base_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()
        assert line.startswith("held "), line + self.proc.stderr.read()
        self.pid, self.run_id = self.proc.pid, line.split()[1]

    def end(self):
        out, err = self.proc.communicate("\n", timeout=60)
        assert self.proc.returncode == 0, err


@pytest.fixture
def holder(tmp_path):
    (tmp_path / "run").mkdir()
    h = Holder(tmp_path / "run" / LOCK_NAME)
    yield h
    if h.proc.poll() is None:
        h.end()


def _trainer(save_folder=None, loggers=(), callbacks=()):
    data = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    model = nn.Linear(4, 2)
    return kiln.Trainer(
        model,
        criterion=nn.CrossEntropyLoss(),
        train_dataloader=DataLoader(data, batch_size=4),
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        max_duration="1ep",
        progress_bar=False,
        save_folder=save_folder,
        loggers=list(loggers),
        callbacks=list(callbacks),
    )


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _record(**fields):
    me = runlock._this_process()
    return {**me, "run_id": "process:other", **fields}


# -- a second live run ----------------------------------------------------------------------------
def test_a_second_live_run_on_the_save_folder_is_refused_with_one_line(tmp_path, holder):
    folder = tmp_path / "run"
    with pytest.raises(FolderInUseError) as err:
        _trainer(save_folder=folder)  # refused when the Trainer is built, before any training
    message = str(err.value)
    assert "\n" not in message
    assert f"save_folder {folder} is in use by another run" in message
    assert f"host {socket.gethostname()}, pid {holder.pid}, run id {holder.run_id}" in message
    assert f"delete {folder / LOCK_NAME}" in message
    # ... and at FIT_START too (a saver used without a Trainer's INIT), writing no checkpoint
    saver = CheckpointSaver(folder, interval="1ba")
    state = build_state(callbacks=[saver])
    with pytest.raises(FolderInUseError, match=f"pid {holder.pid}"):
        saver.run_event(kiln.Event.FIT_START, state, None)
    assert sorted(p.name for p in folder.iterdir()) == [LOCK_NAME]
    # once that run has given the folder back, this one trains in it
    holder.end()
    trainer = _trainer(save_folder=folder)
    trainer.fit()
    assert (folder / "last").exists()


def test_a_lock_from_another_host_is_refused_saying_so(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps(_record(host="node-elsewhere", pid=_dead_pid())))
    with pytest.raises(FolderInUseError, match="host node-elsewhere.*on another host, so kiln cannot check"):
        RunLock(tmp_path / LOCK_NAME, "save_folder", tmp_path).acquire()


# -- stale locks ----------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["dead-pid", "reused-pid", "rebooted", "half-written"])
def test_a_stale_lock_on_this_host_is_taken_over(tmp_path, how):
    path = tmp_path / LOCK_NAME
    if how == "dead-pid":
        path.write_text(json.dumps(_record(pid=_dead_pid())))
    elif how == "reused-pid":  # the pid is alive, but it is a later process than the one that locked
        path.write_text(json.dumps(_record(pid=os.getppid(), start_ticks=1)))
    elif how == "rebooted":
        path.write_text(json.dumps(_record(pid=os.getppid(), boot_id="another-boot")))
    else:  # created, never written: its creator died between the two
        path.write_text("")
        old = time.time() - 60
        os.utime(path, (old, old))
    lock = RunLock(path, "save_folder", tmp_path)
    if how == "half-written":
        lock.acquire()
    else:
        with pytest.warns(UserWarning, match="taking over the lock .* of run process:other"):
            lock.acquire()
    record = json.loads(path.read_text())
    assert (record["pid"], record["run_id"]) == (os.getpid(), runlock.run_id())
    lock.release()
    assert not path.exists()


def test_a_live_process_on_this_host_is_not_taken_for_stale(tmp_path):
    path = tmp_path / LOCK_NAME
    path.write_text(json.dumps(_record(pid=os.getppid(), start_ticks=runlock._start_ticks(os.getppid()))))
    with pytest.raises(FolderInUseError, match=f"pid {os.getppid()}"):
        RunLock(path, "save_folder", tmp_path).acquire()
    assert json.loads(path.read_text())["pid"] == os.getppid()  # left as it was


# -- the same job ---------------------------------------------------------------------------------
def test_the_same_job_is_not_a_conflict_and_a_restart_takes_the_record(tmp_path, monkeypatch):
    # torchrun's restarted attempt: the same run id, rank 0 now another process (the old one gone)
    monkeypatch.setattr(runlock, "run_id", lambda: "torchrun:job7")
    path = tmp_path / LOCK_NAME
    path.write_text(json.dumps(_record(pid=_dead_pid(), run_id="torchrun:job7", host="node-before")))
    lock = RunLock(path, "save_folder", tmp_path)
    lock.acquire()  # no warning, no refusal
    assert json.loads(path.read_text())["pid"] == os.getpid()
    # a second Trainer (or saver) of the same process: its own lock too
    again = RunLock(path, "save_folder", tmp_path)
    again.acquire()
    again.release()
    lock.release()
    assert not path.exists()


def test_a_run_id_is_the_launchers_job_or_one_per_process(monkeypatch):
    monkeypatch.setattr(runlock, "_RUN_IDS", {})
    for name, value in {"WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "abc"}.items():
        monkeypatch.setenv(name, value)
    assert runlock.run_id() == "torchrun:abc"
    monkeypatch.setattr(runlock, "_RUN_IDS", {})
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun without --rdzv-id: every job has it
    assert runlock.run_id().startswith("process:")


# -- given back at the end ------------------------------------------------------------------------
def test_the_lock_is_held_while_fitting_and_given_back_at_fit_end(tmp_path):
    folder = tmp_path / "run"
    held = []

    class Look(kiln.Callback):
        def batch_end(self, state, logger):
            held.append(json.loads((folder / LOCK_NAME).read_text())["pid"])

    _trainer(save_folder=folder, callbacks=[Look()]).fit()
    assert held and set(held) == {os.getpid()}
    assert not (folder / LOCK_NAME).exists()
    assert sorted(p.name for p in folder.iterdir()) == ["ep1-ba2", "last"]


def test_the_lock_is_given_back_at_exit_without_close(tmp_path):
    path = tmp_path / LOCK_NAME
    holder = Holder(path)  # acquires, is told to end, exits without release(): atexit gives it back
    assert json.loads(path.read_text())["pid"] == holder.pid
    holder.end()
    assert not path.exists()


def test_saver_close_gives_the_lock_back(tmp_path):
    saver = CheckpointSaver(tmp_path, interval="1ba")
    state = build_state(callbacks=[saver])
    saver.run_event(kiln.Event.FIT_START, state, None)
    train(state, 1)
    assert (tmp_path / LOCK_NAME).exists()
    saver.close(state, None)
    assert not (tmp_path / LOCK_NAME).exists()


def test_object_store_folders_are_not_locked():
    saver = CheckpointSaver("memory://kiln-runlock-test/run", interval="1ba")
    state = build_state(callbacks=[saver])
    saver.run_event(kiln.Event.FIT_START, state, None)
    train(state, 1)
    saver.run_event(kiln.Event.FIT_END, state, None)
    assert saver._lock is None and not (saver.folder / LOCK_NAME).exists() and (saver.folder / "last").exists()


# -- a log file -----------------------------------------------------------------------------------
def test_a_second_live_run_logging_to_the_same_file_is_refused(tmp_path):
    log = tmp_path / "metrics.jsonl"
    holder = Holder(lock_path_for_file(log))
    try:
        with pytest.raises(
            FolderInUseError, match=f"FileLogger path {log} is in use by another run .*pid {holder.pid}"
        ):
            _trainer(loggers=[FileLogger(log)])
        with pytest.raises(FolderInUseError, match=f"pid {holder.pid}"):
            FileLogger(log).log_metrics({"a": 1.0}, step=1)  # used without a Trainer: at the first write
        assert not log.exists()
    finally:
        holder.end()
    logger = FileLogger(log)
    logger.log_metrics({"a": 1.0}, step=1)
    assert json.loads(lock_path_for_file(log).read_text())["pid"] == os.getpid()
    logger.close()
    assert not lock_path_for_file(log).exists() and log.read_text().count("\n") == 1
