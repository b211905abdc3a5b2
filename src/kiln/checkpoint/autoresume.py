"""Autoresume: continue from the newest checkpoint of the save folder that verifies.

``last`` names the newest checkpoint, but the newest is also the one most likely damaged: a shard
cut short by a full disk or an interrupted copy, bytes flipped on a failing disk. Loading it
fails (and must: see :func:`kiln.checkpoint.load_checkpoint`), and a run that autoresumes at
every restart would fail the same way on every restart. So autoresume tries what ``last`` names,
then the other complete checkpoints, newest saved first; one that fails to load *and* fails
:func:`~kiln.checkpoint.verify_checkpoint` is damaged and skipped, named in one line. One that
verifies but does not load (the run changed: another model, strict keys) is the user's to fix,
and its error is raised as it is. An explicit ``load_path`` is never second-guessed: it fails
loudly. A load checks every file before it changes the state, so a skipped checkpoint leaves
nothing behind in it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from kiln.checkpoint import collectives, layout
from kiln.checkpoint.checkpointing import load_checkpoint, verify_checkpoint
from kiln.checkpoint.errors import CheckpointError
from kiln.checkpoint.storage import as_path
from kiln.core.warn import KilnWarning

__all__ = ["resume_candidates", "load_newest_intact"]


def resume_candidates(folder: Any, storage_options: Mapping[str, Any] | None = None) -> list[Any]:
    """The checkpoints autoresume may load, in the order it tries them: what ``last`` names, then
    every other complete checkpoint of ``folder``, newest saved first. Every rank calls this and
    gets rank 0's list (empty when the folder holds none)."""
    found: list[Any] | CheckpointError = []
    if collectives.rank_and_world()[0] == 0:
        try:
            first = layout.resolve_checkpoint(folder, "last", must_exist=False, storage_options=storage_options)
            others = [path.resolve() for path, _ in reversed(layout.list_checkpoints(as_path(folder, storage_options)))]
            ordered = ([first] if first is not None else []) + others
            found = [path for index, path in enumerate(ordered) if path not in ordered[:index]]
        except CheckpointError as exc:
            found = exc
    found = collectives.broadcast_object(found)
    if isinstance(found, CheckpointError):
        raise found
    return found


def load_newest_intact(
    candidates: list[Any], state: Any, folder: Any, storage_options: Mapping[str, Any] | None = None
) -> Any:
    """Load the first of ``candidates`` that verifies into ``state`` (every rank); returns its path.

    Each damaged one skipped is named in one ``kiln:`` line on rank 0, with the file at fault and
    the checkpoint resumed from instead. Raises the load's own CheckpointError when a checkpoint
    that verifies does not load, and a CheckpointError naming them all when none verifies.
    """
    skipped: list[tuple[Any, CheckpointError]] = []
    for path in candidates:
        try:
            load_checkpoint(path, state, storage_options=storage_options)
        except CheckpointError:
            damage = _damage(path, storage_options)
            if damage is None:
                raise  # intact but not loadable into this run: the user's to see as it is
            skipped.append((path, damage))
            continue
        if collectives.rank_and_world()[0] == 0:
            for bad, damage in skipped:
                warnings.warn(
                    f"autoresume: {bad} is damaged ({damage.path}: {damage.problem}); resumed from {path}, "
                    "the newest checkpoint that verifies",
                    KilnWarning,
                    stacklevel=2,
                )
        return path
    raise CheckpointError(
        as_path(folder, storage_options),
        "has no checkpoint that verifies: "
        + "; ".join(f"{bad.name} ({damage.path}: {damage.problem})" for bad, damage in skipped),
        "copy an intact checkpoint into it, or start afresh in another save folder",
    )


def _damage(path: Any, storage_options: Mapping[str, Any] | None) -> CheckpointError | None:
    """Why ``path`` fails verification (rank 0 checks every file; every rank gets its verdict), or None."""
    verdict: CheckpointError | None = None
    if collectives.rank_and_world()[0] == 0:
        try:
            verify_checkpoint(path, storage_options=storage_options)
        except CheckpointError as exc:
            verdict = exc
    return collectives.broadcast_object(verdict)
