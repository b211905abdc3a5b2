"""`Context`: where this process runs (rank, world, device, config), and the launch functions."""

from __future__ import annotations

import argparse
import math
import os
import random
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from kiln.launch import heartbeat
from kiln.launch.config import Config, load_config
from kiln.launch.environments import LaunchError, from_openmpi, from_slurm, from_torchrun, slurm_address
from kiln.launch.teardown import register_teardown

__all__ = [
    "Context",
    "context",
    "launch",
    "launch_from_torch",
    "launch_from_slurm",
    "launch_from_openmpi",
    "get_default_parser",
    "resolve_device",
    "seed_everything",
]

_BACKENDS = ("auto", "gloo", "nccl", "mpi", "xccl")
DEFAULT_TIMEOUT = 600.0  # seconds, torch's own default for gloo


def _timeout(value: float | timedelta | None) -> timedelta:
    """``timeout=`` as a timedelta: seconds (int or float) or a timedelta, positive; None is the default."""
    if value is None:
        return timedelta(seconds=DEFAULT_TIMEOUT)
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise ValueError(
            f"timeout={value!r} is not a duration; pass seconds (e.g. timeout=600) or a datetime.timedelta"
        )
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"timeout={value!r} must be a positive, finite duration; e.g. timeout=600 (seconds)")
    return timedelta(seconds=seconds)


@dataclass
class Context:
    """The process's place in the job.

    Attributes:
        rank: global rank.
        world_size: number of processes.
        local_rank: rank on this node; picks the CUDA device.
        device: ``cuda:<local_rank>`` when CUDA is there, else ``cpu``.
        config: the run's :class:`kiln.Config`.
        backend: the c10d backend of the default process group (``None`` for a world of 1).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    config: Config = field(default_factory=Config)
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


_CURRENT: Context | None = None
_LAUNCHED = False  # whether _CURRENT came from a launch* call (which wins over joining by itself)


def context() -> Context:
    """The current Context; a world of 1 (or torchrun's variables, if the group exists) otherwise."""
    global _CURRENT
    if _CURRENT is None:
        if dist.is_available() and dist.is_initialized():
            # A group made by someone else (user code, a test): describe it rather than hide it.
            local = int(os.environ.get("LOCAL_RANK", 0))
            _CURRENT = Context(
                dist.get_rank(), dist.get_world_size(), local, _device_for(local), Config(), dist.get_backend()
            )
        else:
            _CURRENT = Context(device=_device_for(0))
    return _CURRENT


def _set_context(ctx: Context | None, launched: bool = False) -> None:
    global _CURRENT, _LAUNCHED
    _CURRENT, _LAUNCHED = ctx, launched and ctx is not None


def launched() -> bool:
    """Whether a ``launch*`` call made the current context (rather than a default world of 1)."""
    return _LAUNCHED


def _device_for(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


_DEVICE_CHOICES = "'cpu', 'gpu', 'cuda', 'cuda:N', a torch.device of those, or None (the best available)"


def resolve_device(device: str | torch.device | None, ctx: Context | None = None) -> torch.device:
    """Where a Trainer's model and batches go, from its ``device=`` argument.

    ``None`` is the context's device (``cuda:<local_rank>`` when CUDA is there, else ``cpu``);
    ``"gpu"`` and ``"cuda"`` are this rank's GPU; ``"cuda:N"`` is GPU N; ``"cpu"`` is the CPU even
    where CUDA is there. Asking for CUDA without it, or the CPU under an nccl process group (NCCL
    moves only CUDA tensors, so the first collective would fail), raises ValueError naming both.
    """
    ctx = ctx or context()
    if device is None:
        return ctx.device
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device={device!r} is not a device; expected {_DEVICE_CHOICES}")
    spec = device.strip().lower() if isinstance(device, str) else device
    try:
        resolved = torch.device("cuda" if spec == "gpu" else spec)
    except RuntimeError:  # torch's message for an unknown string
        raise ValueError(f"device={device!r} is not a device; expected {_DEVICE_CHOICES}") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={device!r} asks for a GPU, but CUDA is not available on this machine "
                "(torch.cuda.is_available() is False); use device='cpu', or None for the best available"
            )
        count = torch.cuda.device_count()
        if resolved.index is None:  # this rank's GPU: the one the launch picked
            resolved = ctx.device if ctx.device.type == "cuda" else torch.device("cuda", ctx.local_rank % count)
        elif resolved.index >= count:
            raise ValueError(
                f"device={device!r} names GPU {resolved.index}, but this machine has {count} "
                f"(cuda:0 to cuda:{count - 1}); use device='cuda' for this rank's GPU"
            )
    elif resolved.type != "cpu":
        raise ValueError(f"device={device!r} is not supported; expected {_DEVICE_CHOICES}")
    if ctx.backend == "nccl" and resolved.type != "cuda":
        raise ValueError(
            f"device={device!r} trains on the CPU, but the process group's backend is nccl, which moves "
            "only CUDA tensors; use device='cuda' (or None), or launch with backend='gloo' to train on "
            "the CPU"
        )
    return resolved


def _resolve_backend(backend: str) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is not known; expected one of {', '.join(_BACKENDS)}")
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def seed_everything(seed: int) -> None:
    """Seed python, numpy (when installed) and torch (all devices)."""
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # numpy is optional
        pass
    torch.manual_seed(seed)


def launch(
    config: Config | dict | str | Path | None = None,
    rank: int = 0,
    world_size: int = 1,
    host: str = "127.0.0.1",
    port: int | str = 29500,
    backend: str = "auto",
    local_rank: int | None = None,
    seed: int | None = None,
    timeout: float | timedelta | None = DEFAULT_TIMEOUT,
    store: dist.Store | None = None,
) -> Context:
    """Join (or create) the default process group and record the :class:`Context`.

    A world of 1 creates no process group: nothing needs one, and it keeps single-process
    runs free of ports.

    ``timeout`` (seconds, or a ``datetime.timedelta``; default 600) bounds every collective and
    the rendezvous: when a rank does not arrive, the others fail after it, naming the rank and
    each rank's last kiln event (:mod:`kiln.launch.heartbeat`).

    Example::

        ctx = kiln.launch(config="config.py", rank=0, world_size=1)
    """
    wait = _timeout(timeout)
    cfg = load_config(config)
    backend = _resolve_backend(backend)
    if world_size < 1 or not 0 <= rank < world_size:
        raise LaunchError(f"rank={rank} and world_size={world_size} are contradictory; expected 0 <= rank < world_size")
    local_rank = rank if local_rank is None else local_rank
    device = _device_for(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    used_backend = None
    if world_size > 1:
        if not dist.is_initialized():
            rendezvous = {"store": store} if store is not None else {"init_method": f"tcp://{host}:{port}"}
            dist.init_process_group(
                backend=backend,
                rank=rank,
                world_size=world_size,
                timeout=wait,
                device_id=device if device.type == "cuda" else None,
                **rendezvous,
            )
        used_backend = dist.get_backend()
        register_teardown()  # a finished rank exits 0 every time (see teardown.py)
        # The store the group was made with (a private accessor: torch has no public one).
        heartbeat.start(dist.distributed_c10d._get_default_store(), rank, world_size, wait.total_seconds())
    ctx = Context(rank, world_size, local_rank, device, cfg, used_backend)
    _set_context(ctx, launched=True)
    if seed is None:
        seed = cfg.get("seed")
    if seed is not None:
        seed_everything(int(seed))
    return ctx


def launch_from_torch(
    config: Config | dict | str | Path | None = None,
    backend: str = "auto",
    seed: int | None = None,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
) -> Context:
    """Launch from torchrun's variables: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.

    ``timeout``: seconds or a ``datetime.timedelta`` (see :func:`launch`)."""
    wait = _timeout(timeout)  # refused before anything connects
    rank, world, local = from_torchrun()
    host, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    return launch(
        config,
        rank,
        world,
        host,
        port,
        backend,
        local,
        seed,
        timeout=wait,
        store=_elastic_store(host, port, world, wait),
    )


def _elastic_store(host: str, port: str, world_size: int, timeout: timedelta) -> dist.Store | None:
    """Under torchrun the agent hosts the store; each restart attempt gets its own key prefix.

    Without the prefix, the workers of a restarted attempt read the addresses the dead attempt's
    workers published under the same keys and hang connecting to them.
    """
    if world_size == 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(host, int(port), world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"kiln/attempt{attempt}", client)


def launch_from_slurm(
    config: Config | dict | str | Path | None = None,
    host: str | None = None,
    port: int | str | None = None,
    backend: str = "auto",
    seed: int | None = None,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
) -> Context:
    """Launch from SLURM's variables: SLURM_PROCID, SLURM_NTASKS (or SLURM_NPROCS), SLURM_LOCALID.

    Rank 0's address is ``host=``/``port=``, else ``MASTER_ADDR``/``MASTER_PORT``, else derived
    from the step: its first node (where SLURM places task 0) and a port computed from
    ``SLURM_JOB_ID`` and the step id (:func:`kiln.launch.environments.slurm_address`).
    ``timeout``: seconds or a ``datetime.timedelta`` (see :func:`launch`)."""
    wait = _timeout(timeout)
    rank, world, local = from_slurm()
    derived_host, derived_port = slurm_address()
    host = host or os.environ.get("MASTER_ADDR") or derived_host
    port = port or os.environ.get("MASTER_PORT") or derived_port
    host, port = _require_address(host, port, "launch_from_slurm")
    return launch(config, rank, world, host, port, backend, local, seed, timeout=wait)


def launch_from_openmpi(
    config: Config | dict | str | Path | None = None,
    host: str | None = None,
    port: int | str | None = None,
    backend: str = "auto",
    seed: int | None = None,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
) -> Context:
    """Launch from Open MPI's variables: OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK.

    ``timeout``: seconds or a ``datetime.timedelta`` (see :func:`launch`)."""
    wait = _timeout(timeout)
    rank, world, local = from_openmpi()
    host, port = _require_address(host, port, "launch_from_openmpi")
    return launch(config, rank, world, host, port, backend, local, seed, timeout=wait)


_ADDRESS_HINT = {
    "launch_from_slurm": " (or SLURM_STEP_NODELIST and SLURM_JOB_ID, which srun sets, to derive them)",
    "launch_from_openmpi": " (e.g. mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=29500)",
}


def _require_address(host: str | None, port: int | str | None, fn: str) -> tuple[str, int | str]:
    host = host or os.environ.get("MASTER_ADDR")
    port = port or os.environ.get("MASTER_PORT")
    if not host or not port:
        missing = " and ".join(n for n, v in (("MASTER_ADDR", host), ("MASTER_PORT", port)) if not v)
        raise LaunchError(
            f"{fn} needs host= and port= (the address of rank 0), or MASTER_ADDR and MASTER_PORT set; "
            f"{missing} is not set{_ADDRESS_HINT.get(fn, '')}"
        )
    return host, port


def get_default_parser() -> argparse.ArgumentParser:
    """The launch arguments Colossal-AI scripts expect: --config --host --port --world_size --rank --local_rank --backend."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=str, help="path to the config file")
    parser.add_argument("--host", type=str, help="the master address for distributed training")
    parser.add_argument("--port", type=int, help="the master port for distributed training")
    parser.add_argument("--world_size", type=int, help="world size for distributed training")
    parser.add_argument("--rank", type=int, help="rank for the default process group")
    parser.add_argument("--local_rank", type=int, help="local rank on the node")
    parser.add_argument("--backend", type=str, default="auto", help="backend for distributed communication")
    return parser


def destroy() -> None:
    """Tear down the process group and forget the context (tests, notebooks)."""
    heartbeat.stop()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _set_context(None)
