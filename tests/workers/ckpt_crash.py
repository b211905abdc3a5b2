"""A fork server for the SIGKILL-while-saving test: pays python's and torch's import once, then
forks one training process per kill, so a kill costs a fork and a few saves instead of ~2 s of imports.

Commands on stdin, one per line; answers on stdout, one per line::

    run FOLDER sync|async fresh|resume   -> "child PID"; the child trains and saves every batch
                                            (keep 2) into FOLDER and prints "saved NAME" after each
                                            save call returns, or "error ..." if it fails
    kill                                 -> SIGKILL to the child; "exit PID STATUS" once it is reaped
                                            (STATUS -9 when the kill did it)
    quit

``resume`` loads ``FOLDER/last`` first (as ``autoresume=True`` does); ``fresh`` starts from scratch
among the earlier runs' checkpoints (a new run pointed at an old folder). Before forking nothing
here leaves a thread running (checked) and torch runs one intra-op thread, so the child is a clean
process. The child is killed only by the server, which reaps it only after the kill: its pid cannot be reused first.
"""

import os
import select
import signal
import sys
import time
import traceback

import torch

import kiln
from kiln.checkpoint import CheckpointSaver, load_checkpoint
from kiln.checkpoint.layout import checkpoint_name, resolve_checkpoint
from workers.ckpt_common import build_state

KEEP = 2
WIDTH = 512


def say(line: str) -> None:
    """One answer line in one write(2): a pipe write of under PIPE_BUF bytes is atomic, so a child
    killed mid-line leaves all of it or none. print() may write the text and its newline apart (it
    does under PYTHONUNBUFFERED): a kill between the two glued the server's next answer onto the
    child's line ("saved ep0-ba18exit 1412 -9"), and the test waited for an "exit" line that never came."""
    os.write(sys.stdout.fileno(), line.encode()[: select.PIPE_BUF - 1] + b"\n")


def step(state) -> None:
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    state.engine.zero_grad()
    state.engine.backward(state.engine.criterion(state.engine(x), y))
    state.engine.optimizer_step()
    state.timestamp.advance_batch(8)


def child(folder: str, mode: str, start: str, server: int) -> None:
    saver = CheckpointSaver(folder, interval="1ba", num_checkpoints_to_keep=KEEP, save_async=mode == "async")
    state = build_state(callbacks=[saver], width=WIDTH)
    last = resolve_checkpoint(folder, "last", must_exist=False) if start == "resume" else None
    if last is not None:
        load_checkpoint(last, state)
    saver.run_event(kiln.Event.FIT_START, state, None)
    while os.getppid() == server:  # a child whose server died (a failed test killed it) stops too
        step(state)
        saver.run_event(kiln.Event.BATCH_CHECKPOINT, state, None)
        # An async save returns before it commits: in an empty folder the test's first kill could
        # otherwise land before any checkpoint exists. Say "saved" only once `last` exists.
        while resolve_checkpoint(folder, "last", must_exist=False) is None:
            time.sleep(0.001)
        say(f"saved {checkpoint_name(state.timestamp.epoch.value, state.timestamp.batch.value)}")


def warm_up() -> None:
    """Save and load once in a scratch folder: the modules a save imports on first use (torch's
    dynamo, via the optimizer, alone takes ~0.5 s) are then imported once, here, not in each child."""
    import shutil
    import tempfile
    import threading

    folder = tempfile.mkdtemp(prefix="kiln-crash-warm-up-")
    try:
        saver = CheckpointSaver(folder, interval="1ba")
        state = build_state(callbacks=[saver], width=WIDTH)
        saver.run_event(kiln.Event.FIT_START, state, None)
        step(state)
        saver.save(state)
        load_checkpoint(folder + "/last", build_state(width=WIDTH))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    # fork() copies only the calling thread: a thread alive now would be missing in every child
    assert threading.active_count() == 1, f"threads alive before forking: {threading.enumerate()}"


def serve() -> None:
    torch.set_num_threads(1)
    warm_up()
    say("ready")
    pid = None
    for line in sys.stdin:
        command, *args = line.split()
        if command == "run":
            sys.stdout.flush()  # a child must not inherit (and print again) buffered output
            server = os.getpid()
            pid = os.fork()
            if pid == 0:
                try:
                    child(*args, server)
                except BaseException:
                    say(f"error {traceback.format_exc(limit=-3)!r}")
                    traceback.print_exc()
                finally:
                    os._exit(1)
            say(f"child {pid}")
        elif command == "kill":
            os.kill(pid, signal.SIGKILL)  # a child that already died is a zombie until reaped: same pid
            _, status = os.waitpid(pid, 0)
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            say(f"exit {pid} {code}")
            pid = None
        elif command == "quit":
            return


if __name__ == "__main__":
    serve()
