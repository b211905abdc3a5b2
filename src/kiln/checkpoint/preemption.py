"""Preemption: SIGTERM or SIGUSR1 means "checkpoint at the end of this batch, then exit".

Clusters announce the end of a job with a signal and a grace period (SLURM: ``--signal=USR1@120``
or SIGTERM at preemption; Kubernetes: SIGTERM). The handler only records the signal; the
``CheckpointSaver`` asks at the end of each batch, all ranks agree (a signal can reach the ranks
at different batches), the checkpoint is written and committed, and the process exits with
:data:`PREEMPTED_EXIT_CODE`, so that ``autoresume=True`` on the next launch continues exactly there.

SLURM. Inside a SLURM job (``SLURM_JOB_ID`` set) a SIGUSR1 also requeues the job: rank 0 runs
``scontrol requeue $SLURM_JOB_ID`` after the checkpoint is committed, and the requeued job, started
again with the same command, autoresumes from it. SIGUSR1 is the signal users ask for ahead of the
time limit (``#SBATCH --signal=USR1@120``, with ``#SBATCH --requeue``) to get exactly this, and
the one Lightning requeues on by default. A SIGTERM only checkpoints and exits: it is what
``scancel`` sends (a cancelled job must stay cancelled) and what SLURM sends at the time limit and
at preemption, where the cluster's own ``PreemptMode=REQUEUE`` requeues the job if it is meant to
be. ``requeue=True`` requeues on every handled signal, ``requeue=False`` never.

Exit status: ``PREEMPTED_EXIT_CODE = 75`` (``EX_TEMPFAIL``, "temporary failure, try again"). It
is non-zero on purpose: the run is not finished, so retry loops, ``torchrun --max-restarts`` and
Kubernetes ``restartPolicy: OnFailure`` start it again, while a finished run exits 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from kiln.checkpoint import collectives
from kiln.core.warn import KilnWarning

__all__ = ["PREEMPTED_EXIT_CODE", "Preempted", "PreemptionHandler"]

PREEMPTED_EXIT_CODE = 75


class Preempted(SystemExit):
    """Raised after the preemption checkpoint is committed; exits the process with status 75 and no traceback."""

    def __init__(self, signal_name: str, code: int = PREEMPTED_EXIT_CODE) -> None:
        super().__init__(code)
        self.signal_name = signal_name


class PreemptionHandler:
    """Records preemption signals and tells every rank, at the same batch, to stop.

    Args:
        signals: signal names to handle (``"SIGTERM"``, ``"SIGUSR1"``, ...).
        requeue: inside a SLURM job, ``scontrol requeue $SLURM_JOB_ID`` from rank 0 before
            exiting: ``None`` (default) after a SIGUSR1 only, ``True`` after any handled signal,
            ``False`` never (see the module's docstring for why SIGTERM is left out by default).

    Example (a plain loop)::

        handler = PreemptionHandler(); handler.install()
        for batch in loader:
            train_step(batch)
            if handler.should_stop():
                save_checkpoint("runs/a", state)
                handler.exit()
    """

    def __init__(self, signals: Sequence[str] = ("SIGTERM", "SIGUSR1"), requeue: bool | None = None) -> None:
        self.signals = []
        for name in signals:
            if not hasattr(signal, name):
                raise ValueError(
                    f"preemption signal {name!r} does not exist on this platform; use names like 'SIGTERM' or 'SIGUSR1'"
                )
            self.signals.append(getattr(signal, name))
        self.requeue = requeue
        self.received: int = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> bool:
        """Install the handlers (main thread only, where Python delivers signals); True if installed."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return bool(self._previous)
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._record)
        return True

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _record(self, signum: int, frame: Any) -> None:
        # Only a flag: the handler runs between two bytecodes of the training step, where
        # writing a checkpoint (or raising) would leave the step half done.
        self.received = self.received or signum

    def should_stop(self) -> bool:
        """Whether any rank received a signal; every rank must call this at the same point."""
        group = collectives.gloo_group("preemption")
        if group is None:
            return bool(self.received)
        flag = torch.tensor([self.received], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        self.received = int(flag.item())
        return bool(self.received)

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""

    def exit(self) -> None:
        """Requeue if asked, then raise :class:`Preempted` (exit status :data:`PREEMPTED_EXIT_CODE`)."""
        self.uninstall()
        job = os.environ.get("SLURM_JOB_ID")
        if job and self.requeues() and collectives.rank_and_world()[0] == 0:
            try:
                subprocess.run(["scontrol", "requeue", job], check=True, timeout=60)
                print(f"kiln: {self.signal_name}: SLURM job {job} requeued (scontrol requeue)", file=sys.stderr)
            except (OSError, subprocess.SubprocessError) as exc:
                warnings.warn(f"could not requeue SLURM job {job}: {exc}", KilnWarning, stacklevel=2)
        raise Preempted(self.signal_name)

    def requeues(self) -> bool:
        """Whether the signal received asks for a requeue (inside SLURM): see ``requeue``."""
        if self.requeue is None:
            return self.received == signal.SIGUSR1
        return bool(self.requeue) and bool(self.received)
