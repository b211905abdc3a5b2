"""Where rank and world size come from: torchrun, SLURM, Open MPI.

Each reader returns ``(rank, world_size, local_rank)`` from its launcher's variables and names the
missing or contradictory variable in a :class:`LaunchError`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["LaunchError", "from_torchrun", "from_slurm", "from_openmpi"]


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
