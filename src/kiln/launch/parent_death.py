"""A worker dies with its launcher: the Linux parent-death signal, armed in each worker of ``kiln run``.

torchrun's agent stops its workers when it is asked to (SIGINT, SIGTERM: it forwards the signal,
waits, then kills), but nothing stops them when the agent itself dies without a word (SIGKILL, the
OOM killer, a crash): the workers are re-parented to init and go on training and writing
checkpoints for nobody. torch has no mechanism for this in its elastic agent (its
``torch.multiprocessing.spawn`` children arm ``PR_SET_PDEATHSIG``; torchrun's ``Popen`` workers do
not). So ``kiln run`` starts every worker through :mod:`kiln.launch.worker`, which calls
:func:`arm` before the script's first line: the kernel then sends the worker SIGKILL the moment
its parent, the ``kiln run`` process that runs the agent in-process, ends.

SIGKILL rather than SIGTERM: the launcher that could collect a result is gone, so nothing is
gained by a graceful stop, and SIGTERM would start kiln's preemption save (checkpoint at the end
of the batch), which needs every rank to agree and may take long. Checkpoints are committed by a
rename, so a killed save leaves ``last`` on the previous complete checkpoint.

Two caveats the code handles. The signal is sent when the parent *thread* that forked the worker
ends; torchrun starts workers from the agent's main thread, whose end is the end of the process.
And a launcher that died before the worker armed the signal never sends it: :func:`arm` compares
the parent with the launcher's pid (``KILN_RUN_PID``) after arming and ends the worker itself
when they differ.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["PARENT_PID_ENV", "arm"]

PARENT_PID_ENV = "KILN_RUN_PID"  # set by `kiln run` to its own pid for the workers it starts
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def arm(parent_pid: int | None = None, sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent ends (Linux; elsewhere a no-op).

    Args:
        parent_pid: the launcher's pid; default ``KILN_RUN_PID`` from the environment. When the
            parent is already another process (the launcher died before this call), this process
            sends ``sig`` to itself.
        sig: the signal (SIGKILL: see the module docstring).

    Returns:
        Whether the signal is armed.
    """
    if parent_pid is None:
        parent_pid = int(os.environ.get(PARENT_PID_ENV) or 0) or None
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):  # no prctl in this libc
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)  # orphaned before the signal was armed: nobody would send it
    return True
