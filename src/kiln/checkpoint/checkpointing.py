"""``save_checkpoint``, ``load_checkpoint`` and ``verify_checkpoint``: the protocol across ranks.

Saving, on every rank::

    rank 0 picks the temporary name (ep3-ba120.tmp-<nonce>) and creates the folder
    every rank writes its files (kiln.checkpoint.formats), hashing them   -- fsynced by the writer
    as it writes; the hashes are gathered
    rank 0 writes manifest.json, renames the folder, points `last` at it  -- the commit
    every rank returns once the checkpoint is visible

On object stores (a URL save folder, see kiln.checkpoint.storage) the files go straight into
``ep3-ba120`` and the manifest, written last, is the commit; ``last`` is a pointer object.

A failure on any rank is raised on every rank (nobody waits forever in a collective), and a crash
at any point leaves only debris next to the previous, intact checkpoints. A save that fails (a full
disk above all) removes its own debris once every rank has stopped writing, so the space it took is
free again; only a crash leaves debris, which the next run's start removes.

The save folder must be one storage that every rank sees (as DCP assumes), and one run writes
into a save folder at a time: a starting run removes the temporary debris it finds there.
"""

from __future__ import annotations

import time
import uuid
import warnings
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from kiln.checkpoint import collectives, layout, verification
from kiln.checkpoint.errors import CheckpointError
from kiln.checkpoint.formats import (
    MERGED_FILE,
    SAVE_TYPES,
    check_save_type,
    read_checkpoint_files,
    read_merged,
    read_merged_file,
    read_training_state,
    write_checkpoint_files,
)
from kiln.checkpoint.hashing import Records, WriteLog
from kiln.checkpoint.serialization import check_dcp_bytes, read_dcp_metadata
from kiln.checkpoint.state import run_config
from kiln.checkpoint.storage import LOCAL as LOCAL_STORAGE
from kiln.checkpoint.storage import as_path, storage_of
from kiln.core.warn import KilnWarning

__all__ = ["save_checkpoint", "load_checkpoint", "verify_checkpoint", "SaveJob"]


class SaveJob:
    """One checkpoint being written: its names, its manifest, and the steps of the protocol."""

    def __init__(
        self,
        folder: Any,
        state: Any,
        save_type: str,
        name: str | None = None,
        metrics: Mapping[str, Any] | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.folder = as_path(folder, storage_options)
        self.storage = storage_of(self.folder)
        self.save_type = check_save_type(save_type)
        self.rank, self.world = collectives.rank_and_world()
        ts = state.timestamp
        self.name = name or layout.checkpoint_name(ts.epoch.value, ts.batch.value)
        nonce = collectives.broadcast_object(uuid.uuid4().hex[:12])  # one temporary name on every rank
        self.tmp = self.storage.staging(self.folder, self.name, nonce)
        self.final = self.folder / self.name
        self.manifest = _manifest(self.name, state, save_type, self.world, metrics)
        self.log = WriteLog()  # this rank's files: checksum and size, taken while writing

    def write(self, state: Any, asynchronous: bool = False, group: Any = None) -> Any:
        """Create the temporary folder and write this rank's files; a DCP future when asynchronous."""
        error = None
        if self.rank == 0:
            try:
                self.storage.prepare(self.tmp)
            except Exception as exc:  # OSError locally; an object store's client raises its own
                error = CheckpointError(self.tmp, f"cannot be created ({exc})", "check the save folder is writable")
        collectives.raise_together(error)
        try:
            future, self.log = write_checkpoint_files(self.tmp, state, self.save_type, asynchronous, group)
            return future
        except CheckpointError as exc:
            error = exc
        except (Exception, CheckpointException) as exc:  # disk full, permissions, DCP's failure: name the folder
            error = self.write_failure(exc)
        self.raise_together_discarding(error)
        return None

    def raise_together_discarding(self, error: BaseException | None) -> None:
        """:func:`collectives.raise_together`, removing the unfinished save first when any rank failed."""
        try:
            collectives.raise_together(error)  # also the barrier: no rank still writes into it
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        """Rank 0: remove what a failed save wrote (its temporary folder; on object stores its files).

        A save that ran out of space would otherwise keep the disk full; nothing of it is a
        checkpoint (no manifest, or no final name), and ``last`` still names the previous one.
        """
        if self.rank != 0 or not self.tmp.exists():
            return
        if not self.storage.renames and (self.tmp / layout.MANIFEST).exists():
            return  # on an object store the manifest was the commit: a complete checkpoint stays
        try:
            layout.remove_checkpoint(self.tmp)
        except Exception as exc:  # noqa: BLE001 - the save's own failure is the error to raise
            warnings.warn(
                f"could not remove the failed save {self.tmp} ({type(exc).__name__}: {exc}); "
                "the next run removes it when it starts",
                KilnWarning,
                stacklevel=3,
            )

    def write_failure(self, exc: BaseException) -> CheckpointError:
        return CheckpointError(
            self.tmp,
            f"could not be written ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''})",
            "check free space and permissions of the save folder; the previous checkpoint is intact",
        )

    def commit_together(self, update_last: bool = True) -> Any:
        """Every rank: hand its files' checksums to rank 0, which writes the manifest and commits."""
        files: Records = {}
        for part in collectives.all_gather_object(self.log.records):  # also the barrier: every file is written
            files.update(part)
        error = None
        if self.rank == 0:
            try:
                self.commit(files, update_last)
            except Exception as exc:  # OSError locally; an object store's client raises its own
                error = CheckpointError(
                    self.final, f"could not be committed ({exc})", "check the save folder is writable"
                )
        self.raise_together_discarding(error)  # also the barrier: everyone returns once it is visible
        return self.final

    def commit(self, files: Records | None = None, update_last: bool = True) -> Any:
        """Rank 0 only: manifest (written last), the commit (a rename on the local disk), then ``last``."""
        if files is None:  # every file's checksum, read back (when no records were taken)
            files = verification.hash_files(self.tmp, layout.list_files(self.tmp))
        layout.write_manifest(self.tmp, {**self.manifest, "files": files})
        layout.commit(self.tmp, self.final)
        if update_last:
            layout.update_link(self.folder, "last", self.name)
        return self.final


def _manifest(name: str, state: Any, save_type: str, world: int, metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    import kiln

    engine = getattr(state, "engine", None)
    strategy = engine.strategy.describe() if engine is not None and hasattr(engine, "strategy") else {"name": "none"}
    numbers = {}
    for key, value in dict(state.metrics if metrics is None else metrics).items():
        try:
            numbers[key] = float(value)
        except (TypeError, ValueError):
            continue
    now = time.time()
    return {
        "format": layout.FORMAT_NAME,
        "format_version": layout.FORMAT_VERSION,
        "name": name,
        "created": datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"),
        "created_unix": now,
        "timestamp": state.timestamp.state_dict(),
        "world_size": world,
        "strategy": strategy,
        "save_type": save_type,
        "metrics": numbers,
        "run_name": getattr(state, "run_name", None),
        "precision": str(getattr(engine, "precision", None)) if engine is not None else None,
        "config": run_config(state),
        "torch_version": torch.__version__,
        "kiln_version": kiln.__version__,
    }


def save_checkpoint(
    folder: Any,
    state: Any,
    save_type: str = "sharded",
    *,
    name: str | None = None,
    metrics: Mapping[str, Any] | None = None,
    update_last: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> Any:
    """Write a checkpoint of ``state`` into ``folder``; every rank must call it. Returns its path.

    Args:
        folder: the save folder (created if needed), a local path or an fsspec URL (``s3://bucket/run``);
            the checkpoint is ``folder/ep{E}-ba{B}``.
        state: the kiln ``State`` (with ``state.engine`` for the wrapped model and optimizer).
        save_type: ``"sharded"``, ``"deduped"`` or ``"merged"`` (see :mod:`kiln.checkpoint.formats`).
        name: the folder name instead of ``ep{E}-ba{B}``.
        metrics: recorded in the manifest (default ``state.metrics``).
        update_last: point ``folder/last`` at the new checkpoint.
        storage_options: for a URL, the fsspec filesystem's options (credentials, ``endpoint_url``, ...).

    Example::

        path = kiln.checkpoint.save_checkpoint("runs/a", trainer.state)
    """
    job = SaveJob(folder, state, save_type, name, metrics, storage_options)
    job.write(state)
    return job.commit_together(update_last)


def load_checkpoint(
    path: Any,
    state: Any,
    *,
    folder: Any = None,
    strict: bool = True,
    verify: bool = True,
    restore_rng: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Load a checkpoint into ``state`` for an exact resume; every rank must call it. Returns its manifest.

    Args:
        path: a checkpoint folder, ``"last"``/``"best"`` (inside ``folder``), a save folder, or a
            ``.pt``/``.pth`` file from ``kiln checkpoint merge`` (no manifest checksums: only its
            structure is checked); a local path or an fsspec URL.
        state: the kiln ``State`` to restore (model, optimizer, schedulers, scaler, timestamp, RNG,
            the training loader's position, callbacks, algorithms).
        folder: where ``"last"``/``"best"`` live.
        strict: every model tensor must be in the checkpoint and vice versa (shapes must always match).
        verify: check every file's checksum (each rank checks a share); False checks only sizes.
        restore_rng: restore this rank's RNG states (only possible on the world size it was saved with).
        storage_options: for a URL, the fsspec filesystem's options (credentials, ``endpoint_url``, ...).

    Raises:
        CheckpointError: naming the file and the problem, on every rank.
    """
    rank, world = collectives.rank_and_world()
    error, manifest = None, None
    found: Any = None
    if rank == 0:  # one rank resolves links, so every rank loads the same checkpoint
        try:
            found = layout.resolve_checkpoint(folder, path, storage_options=storage_options)
        except CheckpointError as exc:
            found = exc
    found = collectives.broadcast_object(found)  # a Path, or a RemotePath (which pickles with its options)
    if isinstance(found, CheckpointError):
        raise found
    resolved = found
    merged, pending = None, None
    try:
        if resolved.is_file():  # every rank reads a merged file whole, as it reads a merged checkpoint.pt
            manifest, merged = read_merged_file(resolved)
        else:
            manifest = layout.read_manifest(resolved)
            if manifest.get("save_type") not in SAVE_TYPES:
                raise CheckpointError(
                    resolved / layout.MANIFEST, f"has an unknown save_type {manifest.get('save_type')!r}"
                )
            pending = _start_verification(resolved, manifest, sorted(manifest["files"])[rank::world], verify)
    except CheckpointError as exc:
        error = exc
    try:
        collectives.raise_together(error)
        assert manifest is not None  # read above, or raise_together raised on every rank
        try:
            read_checkpoint_files(
                resolved, manifest, state, strict=strict, restore_rng=restore_rng, merged=merged, checksums=pending
            )
        except CheckpointError as exc:
            error = exc
        except Exception as exc:  # torch's own errors, from deep inside: say which checkpoint and what
            error = CheckpointError(
                resolved,
                f"could not be loaded into this run ({type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''})",
            )
        collectives.raise_together(error)
    finally:
        if pending is not None:
            pending.error()  # its threads are gone however the load ended
    return manifest


def _start_verification(path: Any, manifest: dict[str, Any], share: list[str], checksums: bool) -> Any:
    """Check this rank's share of the files; nothing changes in the state unless every file matches.

    Sizes are checked now, and the checksums of the small files. The large ones (DCP's ``.distcp``
    files) are hashed in background threads while DCP plans the load; its reader reads nothing
    until they matched on every rank (the returned PendingChecksums, None when there are none).
    """
    verification.verify_files(path, manifest, share, checksums=False)
    if not checksums:
        return None
    large = [name for name in share if name.endswith(".distcp")]
    verification.PendingChecksums(path, manifest, [name for name in share if name not in large]).finish()
    if not large:
        return None
    # On an object store the checksum pass keeps what it downloaded, for the load to read.
    keep = storage_of(path) is not LOCAL_STORAGE and (
        sum(int(manifest["files"][name]["bytes"]) for name in large) <= verification.memory_to_spare()
    )
    return verification.PendingChecksums(path, manifest, large, keep=keep)


def verify_checkpoint(
    path: Any, *, checksums: bool = True, storage_options: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Check a checkpoint folder: complete, known format version, every file's size and checksum, and
    that every pickled part (``.metadata``, each non-tensor entry of the ``.distcp`` files, the
    ``.pt`` files) loads without running code. Returns the manifest; raises CheckpointError.

    ``checksums=False`` skips the checksum of each file (sizes are still checked): the quick check
    ``kiln checkpoint inspect`` makes. A ``.pt``/``.pth`` file from ``kiln checkpoint merge`` has no
    checksums; its pickle and structure are checked and its manifest returned.

    Example::

        kiln.checkpoint.verify_checkpoint("runs/a/last")   # or: kiln checkpoint verify runs/a/last
    """
    path = as_path(path, storage_options)
    if path.name in layout.LINKS and not storage_of(path).renames:
        path = layout.resolve_checkpoint(None, path)  # a pointer object on an object store: what it names
    if path.is_file():
        return read_merged_file(path)[0]
    manifest = layout.read_manifest(path)
    if manifest.get("save_type") not in SAVE_TYPES:
        raise CheckpointError(path / layout.MANIFEST, f"has an unknown save_type {manifest.get('save_type')!r}")
    verification.verify_files(path, manifest, checksums=checksums)
    if manifest["save_type"] == "merged":
        read_merged(path / MERGED_FILE)
    else:
        check_dcp_bytes(path, read_dcp_metadata(path))
    for name in manifest["files"]:
        if name.endswith(".pt") and name != MERGED_FILE:
            read_training_state(path / name)
    return manifest
