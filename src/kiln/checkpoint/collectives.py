"""The few collectives checkpointing needs, all no-ops in a world of one process."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from kiln.checkpoint.errors import CheckpointError

__all__ = ["rank_and_world", "barrier", "broadcast_object", "all_gather_object", "raise_together", "gloo_group"]


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _active() else (0, 1)


def barrier(group: Any = None) -> None:
    if _active():
        dist.barrier(group=group)


def broadcast_object(obj: Any, group: Any = None) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    if not _active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def raise_together(error: BaseException | None, group: Any = None) -> None:
    """Raise on every rank if any rank failed, so that no rank waits forever in the next collective.

    The first failing rank's error is raised everywhere (as a CheckpointError when it was not one).
    """
    errors = all_gather_object(_portable(error), group)
    if error is not None:
        raise error  # this rank's own, with its traceback
    for rank, err in enumerate(errors):
        if err is not None:
            raise err if isinstance(err, CheckpointError) else CheckpointError(f"<rank {rank}>", str(err))


def _portable(error: BaseException | None) -> Any:
    if error is None or isinstance(error, CheckpointError):
        return error
    return f"{type(error).__name__}: {error}"  # arbitrary exceptions may not pickle


_GLOO_GROUPS: dict[str, Any] = {}


def gloo_group(purpose: str) -> Any:
    """A gloo process group used only for ``purpose`` (None in a world of one).

    Checkpointing talks between ranks from a background thread (async saves) and on every batch
    (preemption); each gets its own group, because collectives on a shared group from two threads
    can be issued in different orders on different ranks, which deadlocks or mixes up messages.
    Created on first use; every rank reaches that first use at the same point of the loop.
    """
    if not _active():
        return None
    world = dist.group.WORLD
    cached = _GLOO_GROUPS.get(purpose)
    if cached is None or cached[0] is not world:  # a new default group (destroyed and launched again)
        _GLOO_GROUPS[purpose] = (world, dist.new_group(backend="gloo"))
    return _GLOO_GROUPS[purpose][1]
