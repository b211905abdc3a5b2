"""Checkpoints written while training continues (``save_async=True``), on DCP's ``async_save``.

The training thread pays only for copying the tensors to CPU memory (DCP's staging) and writing
the small per-rank training state. The tensors are written (uploaded, on object stores) by DCP's
background thread, hashed as they go; once DCP's coordinator has collected every rank's write
results, which is exactly "all ranks finished", every rank's background thread hands its files'
checksums to rank 0 over the same dedicated group, and rank 0 commits (manifest, rename or
nothing more on object stores, ``last``). A checkpoint never becomes visible while any rank is
still writing, and a failure on any rank leaves only debris.

(The module is not called ``async``: that is a Python keyword and could not be imported.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from kiln.checkpoint import collectives
from kiln.checkpoint.checkpointing import SaveJob
from kiln.checkpoint.errors import CheckpointError

__all__ = ["AsyncCheckpoint", "start_async_save"]


class AsyncCheckpoint:
    """A checkpoint being written in the background; ``wait()`` for it, ``done()`` to poll."""

    def __init__(
        self,
        job: SaveJob,
        future: Any,
        update_last: bool,
        on_commit: Callable[[Any], None] | None,
        group: Any = None,
    ) -> None:
        self.job = job
        self.name = job.name
        self._future = future
        self._group = group
        self._update_last = update_last
        self._on_commit = on_commit
        self._error: BaseException | None = None
        self.path: Any = None
        # Not a daemon: an interpreter exiting right after fit() still finishes the checkpoint.
        self._thread = threading.Thread(target=self._finish, name=f"kiln-checkpoint-{job.name}")
        self._thread.start()

    def _finish(self) -> None:
        try:
            written: Any = None
            try:
                try:
                    self._future.result()
                finally:
                    self.job.log.check()  # the failure as it was raised, also one DCP's threads dropped
                written = self.job.log.records
            except BaseException as exc:
                written = self.job.write_failure(exc).problem
            # Every rank takes part, failed or not, so that no rank waits here forever.
            everyone = collectives.all_gather_object(written, self._group)
            failed = [(rank, part) for rank, part in enumerate(everyone) if not isinstance(part, dict)]
            if failed:
                self.job.discard()  # every rank has stopped writing: free the space it took
                rank, problem = failed[0]
                raise CheckpointError(
                    self.job.tmp,
                    f"the background save failed on rank {rank}: {problem}",
                    "check free space and permissions of the save folder; the previous checkpoint is intact",
                )
            if self.job.rank == 0:
                files: dict[str, Any] = {}
                for part in everyone:
                    files.update(part)
                try:
                    self.path = self.job.commit(files, self._update_last)
                except BaseException:
                    self.job.discard()
                    raise
                if self._on_commit is not None:
                    self._on_commit(self.path)
        except BaseException as exc:  # reported by wait(), in the training thread
            self._error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> CheckpointError | None:
        """Block until written and committed; returns the failure (not raised, so that the caller
        can raise it on every rank together)."""
        self._thread.join()
        if self._error is None or isinstance(self._error, CheckpointError):
            return self._error
        return CheckpointError(
            self.job.tmp,
            f"the background save failed ({type(self._error).__name__}: {self._error})",
            "check free space and permissions of the save folder; the previous checkpoint is intact",
        )


def start_async_save(
    folder: Any,
    state: Any,
    save_type: str,
    *,
    name: str | None = None,
    metrics: dict[str, Any] | None = None,
    update_last: bool = True,
    on_commit: Callable[[Any], None] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> AsyncCheckpoint:
    """Stage ``state`` and write it in the background; every rank calls this at the same point.

    ``on_commit(path)`` runs on rank 0 after the commit (retention, the ``best`` link).
    """
    if save_type == "merged":
        raise ValueError(
            "save_async=True needs save_type 'sharded' or 'deduped'; a merged checkpoint is "
            "assembled on rank 0 and cannot be written in the background"
        )
    group = collectives.gloo_group("async-save")  # DCP's collectives run in a background thread
    job = SaveJob(folder, state, save_type, name, metrics, storage_options)
    future = job.write(state, asynchronous=True, group=group)
    return AsyncCheckpoint(job, future, update_last, on_commit, group)
