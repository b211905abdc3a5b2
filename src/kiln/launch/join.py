"""Joining the launcher's world by oneself: what the Trainer, ``kiln.initialize`` and the config CLI do first.

``kiln run -n 2 train.py`` (or torchrun, ``srun``, ``mpirun``) starts N copies of a script. A
copy that never joins a process group trains alone: N independent runs that each iterate the
whole dataset and write the same checkpoints and logs. Composer and Lightning join by themselves;
so does kiln, here and only here, so that the three front doors agree on when and how.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from kiln.launch.context import (
    DEFAULT_TIMEOUT,
    Context,
    context,
    launch_from_openmpi,
    launch_from_slurm,
    launch_from_torch,
    launched,
)
from kiln.launch.environments import detect

__all__ = ["join_launcher"]

_LAUNCHERS: dict[str, Callable[..., Context]] = {
    "torchrun": launch_from_torch,
    "Open MPI": launch_from_openmpi,
    "SLURM": launch_from_slurm,
}


def join_launcher(timeout: float | timedelta = DEFAULT_TIMEOUT) -> Context:
    """The current :class:`Context`, joining the launcher's process group first when nothing else did.

    * A ``kiln.launch*`` call made the context: it wins, whatever the environment says.
    * A process group exists already (user code, another library): it is described as it is.
    * The environment says this process is one rank of a job of more than one process
      (:func:`kiln.launch.environments.detect`: torchrun or ``kiln run``, Open MPI, a SLURM job
      step): ``launch_from_torch()``, ``launch_from_openmpi()`` or ``launch_from_slurm()`` is
      called, exactly as the script could have (``timeout`` is passed along).
    * Otherwise a world of one: no process group, as without any launcher.

    A launcher's variables that are missing or contradictory raise :class:`kiln.LaunchError` naming
    them, rather than falling back to a world of one (which would train N separate copies).
    """
    if launched() or (dist.is_available() and dist.is_initialized()):
        return context()
    found = detect()
    if found is None or found.world_size == 1:
        return context()
    return _LAUNCHERS[found.name](timeout=timeout)
