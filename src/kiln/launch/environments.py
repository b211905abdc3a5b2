"""Where rank and world size come from: torchrun, SLURM, Open MPI.

Each reader returns ``(rank, world_size, local_rank)`` from its launcher's variables and names the
missing or contradictory variable in a :class:`LaunchError`. :func:`detect` says which launcher, if
any, started this process as one rank of a larger job; :func:`slurm_address` and :func:`job_id`
derive what a launcher leaves implicit (rank 0's address under SLURM, the job's identity).
"""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Mapping
from typing import NamedTuple

__all__ = [
    "LaunchError",
    "Launcher",
    "detect",
    "from_torchrun",
    "from_slurm",
    "from_openmpi",
    "job_id",
    "node_of",
    "slurm_address",
]


class LaunchError(RuntimeError):
    """The environment does not describe a valid process group."""


def _read_int(env: Mapping[str, str], names: tuple[str, ...], launcher: str) -> int:
    for name in names:
        raw = env.get(name)
        if raw is not None:
            try:
                return int(raw)
            except ValueError:
                raise LaunchError(
                    f"environment variable {name}={raw!r} is not an integer (set by {launcher})"
                ) from None
    shown = " or ".join(names)
    raise LaunchError(
        f"environment variable {shown} is not set; expected it from {launcher}. Start the script with {_HOW[launcher]}"
    )


_HOW = {
    "torchrun": "`torchrun` or `kiln run -n N script.py`",
    "SLURM": "`srun` inside a SLURM allocation",
    "Open MPI": "`mpirun -np N`",
}


def _check(
    rank: int, world_size: int, local_rank: int, names: tuple[str, str, str], launcher: str
) -> tuple[int, int, int]:
    if world_size < 1:
        raise LaunchError(f"{names[1]}={world_size} must be at least 1 (from {launcher})")
    if not 0 <= rank < world_size:
        raise LaunchError(f"{names[0]}={rank} is outside [0, {names[1]}={world_size}) (from {launcher})")
    if not 0 <= local_rank <= rank:
        raise LaunchError(f"{names[2]}={local_rank} must be between 0 and {names[0]}={rank} (from {launcher})")
    return rank, world_size, local_rank


def from_torchrun(env: Mapping[str, str] | None = None) -> tuple[int, int, int]:
    env = os.environ if env is None else env
    rank = _read_int(env, ("RANK",), "torchrun")
    world = _read_int(env, ("WORLD_SIZE",), "torchrun")
    local = _read_int(env, ("LOCAL_RANK",), "torchrun")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in env:
            raise LaunchError(
                f"environment variable {name} is not set; expected it from torchrun. Start the script with {_HOW['torchrun']}"
            )
    return _check(rank, world, local, ("RANK", "WORLD_SIZE", "LOCAL_RANK"), "torchrun")


def from_slurm(env: Mapping[str, str] | None = None) -> tuple[int, int, int]:
    env = os.environ if env is None else env
    rank = _read_int(env, ("SLURM_PROCID",), "SLURM")
    world = _read_int(env, ("SLURM_NTASKS", "SLURM_NPROCS"), "SLURM")
    local = _read_int(env, ("SLURM_LOCALID",), "SLURM")
    return _check(rank, world, local, ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"), "SLURM")


def from_openmpi(env: Mapping[str, str] | None = None) -> tuple[int, int, int]:
    env = os.environ if env is None else env
    names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")
    rank, world, local = (_read_int(env, (n,), "Open MPI") for n in names)
    return _check(rank, world, local, names, "Open MPI")


# -- which launcher started this process ----------------------------------------------------------
class Launcher(NamedTuple):
    """A launcher found in the environment, and this process's place in its job."""

    name: str  # "torchrun", "Open MPI" or "SLURM" (as in LaunchError messages)
    rank: int
    world_size: int
    local_rank: int


_SLURM_STEP = ("SLURM_STEP_ID", "SLURM_STEPID")


def detect(env: Mapping[str, str] | None = None) -> Launcher | None:
    """The launcher that started this process as one rank of a job, or None for a process alone.

    In this order, because launchers nest: torchrun's variables (``WORLD_SIZE`` and ``RANK``; set
    by ``kiln run`` and torchrun, also when torchrun runs inside an ``srun`` task or an allocation);
    Open MPI's ``OMPI_COMM_WORLD_SIZE`` > 1 (set by ``mpirun`` for each application process; under
    SLURM, mpirun starts its daemons through srun, so the SLURM task variables describe the daemons,
    one per node, not the ranks); SLURM's ``SLURM_NTASKS`` (or ``SLURM_NPROCS``) > 1 in a job step
    (``SLURM_STEP_ID`` is set by ``srun``; a batch script or an ``salloc`` shell has the job's task
    count but is one process, which must not wait for peers that will never come).

    torchrun is returned for any world size (``kiln run -n 1`` is still torchrun); the others only
    for a world larger than one. Malformed or missing companion variables raise
    :class:`LaunchError` naming them, as the ``from_*`` readers do.
    """
    env = os.environ if env is None else env
    if "WORLD_SIZE" in env and "RANK" in env:
        return Launcher("torchrun", *from_torchrun(env))
    if "OMPI_COMM_WORLD_SIZE" in env and _read_int(env, ("OMPI_COMM_WORLD_SIZE",), "Open MPI") > 1:
        return Launcher("Open MPI", *from_openmpi(env))
    if any(name in env for name in _SLURM_STEP):
        if _read_int(env, ("SLURM_NTASKS", "SLURM_NPROCS"), "SLURM") > 1:
            return Launcher("SLURM", *from_slurm(env))
    return None


def node_of(env: Mapping[str, str] | None = None) -> tuple[int | None, int | None]:
    """This process's node and the job's number of nodes, as its launcher numbers them, or Nones.

    torchrun's ``GROUP_RANK`` and ``GROUP_WORLD_SIZE`` (one agent per node); in a SLURM job step,
    ``SLURM_NODEID`` and the step's node count (``SLURM_STEP_NUM_NODES``, else the job's
    ``SLURM_JOB_NUM_NODES``/``SLURM_NNODES``). Open MPI numbers no nodes. Malformed values are
    left out (None): this only describes a process, it never decides where it runs.
    """
    env = os.environ if env is None else env

    def first(*names: str) -> int | None:
        raw = next((env[n] for n in names if n in env), None)
        return int(raw) if raw is not None and raw.isdigit() else None

    if "WORLD_SIZE" in env and "RANK" in env:
        return first("GROUP_RANK"), first("GROUP_WORLD_SIZE")
    if any(name in env for name in _SLURM_STEP):
        return first("SLURM_NODEID"), first("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
    return None, None


# The port rank 0 listens on when MASTER_PORT is not set: the same in every task of one job step
# (all derive it from the job and step ids), spread over [15000, 25000) so that the steps of
# different jobs sharing a first node rarely meet (MASTER_PORT chooses one explicitly).
SLURM_PORT_BASE, SLURM_PORT_SPAN = 15000, 10000


def slurm_address(env: Mapping[str, str] | None = None) -> tuple[str | None, int | None]:
    """Rank 0's address under ``srun`` without ``MASTER_ADDR``/``MASTER_PORT``: ``(host, port)``.

    The host is the first node of the step (``SLURM_STEP_NODELIST``, else the job's
    ``SLURM_JOB_NODELIST``/``SLURM_NODELIST``), where SLURM places task 0; the port is derived from
    ``SLURM_JOB_ID`` and the step id. Either is None when its variables are missing.
    """
    env = os.environ if env is None else env
    nodelist = next(
        (env[n] for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(n)), None
    )
    host = first_host(nodelist) if nodelist else None
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    port = None
    if job:
        step = next((env[n] for n in _SLURM_STEP if n in env), "0")
        port = SLURM_PORT_BASE + zlib.crc32(f"{job}.{step}".encode()) % SLURM_PORT_SPAN
    return host, port


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: ``"gpu[07-09,12],cpu1"`` -> ``"gpu07"``.

    What ``scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1`` prints, without calling it
    (the command may not exist inside a container).
    """
    first = re.split(r",(?![^\[]*\])", nodelist.strip(), maxsplit=1)[0]  # commas outside brackets
    # Each bracket expression contributes its first member: "n[3-5]-ib" -> "n3-ib"
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], first)


def job_id(env: Mapping[str, str] | None = None) -> str | None:
    """The launcher's id of this job, the same in every rank (and across torchrun restarts), or None.

    torchrun's ``TORCHELASTIC_RUN_ID`` (not torchrun's placeholder ``none``: without ``--rdzv-id``
    or ``--standalone`` every job has it), SLURM's job and step ids, Open MPI's job id.
    """
    env = os.environ if env is None else env
    run = env.get("TORCHELASTIC_RUN_ID")
    if "WORLD_SIZE" in env and run and run != "none":
        return f"torchrun:{run}"
    ompi = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE")
    if "OMPI_COMM_WORLD_SIZE" in env and ompi:
        return f"openmpi:{ompi}"
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    step = next((env[n] for n in _SLURM_STEP if n in env), None)
    if job and step is not None:
        return f"slurm:{job}.{step}"
    return None
