"""The checkpoint folder on disk: names, atomic commit, manifest, links, retention.

::

    save_folder/
      ep3-ba120/                 one checkpoint; written as ep3-ba120.tmp-<nonce>, renamed when complete
        manifest.json            written last: format version, timestamp, world size, save type,
                                 metrics, the checksum (xxh3_128) and size of every other file, and
                                 the sha256 of its own content (manifest_sha256)
        ...                      the files of the save type (see kiln.checkpoint.formats)
      last -> ep3-ba120          relative symlinks (a copy where links are impossible; a small
      best -> ep2-ba80           pointer object on object stores)

Everything here is storage work on one process; kiln.checkpoint.checkpointing decides which rank
does what. The save folder is a local path or an fsspec URL; what differs between the two (rename
or manifest-last commit, symlinks or pointer objects) is in :mod:`kiln.checkpoint.storage`. Crash
safety comes from one rule on every storage: nothing without a manifest is a checkpoint, and the
manifest is written after every other file. On the local disk a folder also only gets its final
name by one ``rename``, and links are replaced by one ``rename`` of a new link over the old one. A
crash at any moment therefore leaves either the old or the new state, plus debris (``*.tmp-*``, or
on object stores a folder without a manifest) that is ignored and later removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from kiln.checkpoint.errors import CheckpointError
from kiln.checkpoint.storage import (
    MANIFEST,
    TMP,
    RemotePath,
    as_path,
    fsync_dir,
    is_temporary,
    storage_of,
    temporary_name,
)
from kiln.core.warn import KilnWarning

__all__ = [
    "check_num_checkpoints_to_keep",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST",
    "MANIFEST_CHECKSUM",
    "LINKS",
    "checkpoint_name",
    "TMP",
    "is_temporary",
    "temporary_name",
    "write_durably",
    "fsync_dir",
    "list_files",
    "write_manifest",
    "read_manifest",
    "check_manifest",
    "commit",
    "update_link",
    "link_target",
    "list_checkpoints",
    "find_latest",
    "apply_retention",
    "remove_checkpoint",
    "cleanup_temporary",
    "resolve_checkpoint",
]

FORMAT_NAME = "kiln-checkpoint"
FORMAT_VERSION = 1  # bump when a reader of the old version could not load the new layout
MANIFEST_CHECKSUM = "manifest_sha256"
LINKS = ("last", "best")


def checkpoint_name(epoch: int, batch: int) -> str:
    """``ep{epoch}-ba{batch}``: sorts by progress when read, names the resume point exactly."""
    return f"ep{int(epoch)}-ba{int(batch)}"


# -- durable files ------------------------------------------------------------------------------
def write_durably(path: Any, data: bytes) -> None:
    """Write ``data`` so that it survives a crash (write + fsync, or one PUT on object stores): a
    commit that makes the folder visible must never expose unflushed bytes."""
    path = as_path(path)
    storage_of(path).write_durably(path, data)


def list_files(root: Any) -> list[str]:
    """Every file under ``root`` except the manifest, as sorted relative POSIX paths."""
    root = as_path(root)
    names = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
    return sorted(n for n in names if n != MANIFEST)


# -- manifest -----------------------------------------------------------------------------------
def write_manifest(folder: Any, manifest: dict[str, Any]) -> None:
    """Write ``folder/manifest.json`` with its own checksum (any earlier one is replaced)."""
    folder = as_path(folder)
    plain = json.loads(json.dumps({k: v for k, v in manifest.items() if k != MANIFEST_CHECKSUM}, default=_json_default))
    plain[MANIFEST_CHECKSUM] = _manifest_digest(plain)
    write_durably(folder / MANIFEST, json.dumps(plain, indent=2, sort_keys=True).encode())
    fsync_dir(folder)


def _manifest_digest(manifest: dict[str, Any]) -> str:
    # The manifest vouches for every other file; this vouches for the manifest. It covers the
    # parsed content in a canonical form, so reformatting the file (spaces) changes nothing.
    content = {k: v for k, v in manifest.items() if k != MANIFEST_CHECKSUM}
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _json_default(value: Any) -> Any:
    item = getattr(value, "item", None)  # tensors and numpy scalars
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(value)  # the readable form (a Time is "10ep"): the manifest is for people and tools


def read_manifest(path: Any) -> dict[str, Any]:
    """The manifest of the checkpoint folder ``path``; a CheckpointError if it is not a complete one."""
    path = as_path(path)
    if not path.exists():
        raise CheckpointError(path, "does not exist", "check the path (a checkpoint is a folder such as ep3-ba120)")
    if not path.is_dir():
        raise CheckpointError(
            path,
            "is a file, not a checkpoint folder",
            "pass the folder that holds manifest.json (use `kiln checkpoint inspect` to look inside)",
        )
    file = path / MANIFEST
    if not file.is_file():
        why = (
            "a save that did not finish"
            if is_temporary(path.name)
            else "no manifest.json, so it is not a complete kiln checkpoint"
        )
        raise CheckpointError(
            path, f"{why} (manifest.json is missing)", "load an earlier checkpoint, e.g. the 'last' link"
        )
    try:
        manifest = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:  # FileNotFoundError: deleted meanwhile
        raise CheckpointError(
            file, f"is not valid JSON ({exc})", "the manifest is damaged; load an earlier checkpoint"
        ) from None
    check_manifest(file, manifest)
    recorded = manifest.get(MANIFEST_CHECKSUM)  # absent in manifests of kiln before it was added
    if recorded is not None and recorded != _manifest_digest(manifest):
        raise CheckpointError(
            file,
            f"is corrupt: its content does not match its own checksum ({MANIFEST_CHECKSUM})",
            "the manifest was damaged or edited; copy the checkpoint again or load another",
        )
    if not isinstance(manifest.get("files"), dict) or not all(isinstance(r, dict) for r in manifest["files"].values()):
        raise CheckpointError(file, "lists no files (the 'files' table is missing or malformed)")
    return manifest


def check_manifest(source: str | os.PathLike, manifest: Any) -> None:
    """Raise naming ``source`` unless ``manifest`` is a kiln manifest of a format version this kiln reads."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(source, f"is not a kiln checkpoint manifest (format={_get(manifest, 'format')!r})")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise CheckpointError(source, f"has an invalid format_version {version!r}")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            source,
            f"has format version {version}, newer than this kiln reads (up to {FORMAT_VERSION})",
            "upgrade kiln to load it",
        )
    world = manifest.get("world_size", 1)
    if type(world) is not int or world < 1:
        raise CheckpointError(source, f"has an invalid world_size {world!r}")


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else None


# -- commit and links ---------------------------------------------------------------------------
def commit(tmp_dir: Any, final_dir: Any) -> Any:
    """Make a finished save (its manifest written) visible under its final name.

    On the local disk: one atomic rename (an existing checkpoint of the same name, a run that
    resumed and saved the same step again, is first renamed aside, so the old one stays whole until
    the new one is in place). On object stores the save was written in its final folder and its
    manifest was the commit.
    """
    tmp_dir, final_dir = as_path(tmp_dir), as_path(final_dir)
    return storage_of(tmp_dir).commit(tmp_dir, final_dir)


def update_link(folder: Any, link: str, target: str) -> None:
    """Point ``folder/link`` at ``folder/target`` atomically: a relative symlink, else a copy (local),
    or a pointer object (object stores)."""
    folder = as_path(folder)
    storage_of(folder).update_link(folder, link, target)


def link_target(folder: Any, link: str) -> str | None:
    """The name of the checkpoint ``folder/link`` stands for (a link's target, a copy's own name, a pointer's)."""
    folder = as_path(folder)
    return storage_of(folder).link_target(folder, link)


# -- the set of checkpoints ---------------------------------------------------------------------
def list_checkpoints(folder: Any) -> list[tuple[Any, dict[str, Any]]]:
    """Complete checkpoints in ``folder`` (not links, not temporaries), in the order they were saved.

    Save order, not training progress: a run started again from scratch, or from an earlier
    checkpoint, writes checkpoints of less progress than the previous run left there, and those
    are the newer ones (``last`` points at them). Ordering by progress made retention delete the
    new run's checkpoints and keep the stale ones, and the ``last`` fallback pick a stale one.
    """
    folder = as_path(folder)
    if not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        if entry.name in LINKS or is_temporary(entry.name) or entry.is_symlink() or not entry.is_dir():
            continue
        try:
            manifest = read_manifest(entry)
        except CheckpointError:
            continue
        found.append((entry, manifest))
    return sorted(found, key=lambda item: _save_order_key(item[1]))


def _save_order_key(manifest: dict[str, Any]) -> tuple:
    # created_unix is rank 0's clock when the save began; one save is in flight at a time, so it
    # orders one run's saves, and runs that follow each other in a folder are minutes apart.
    # Progress only breaks ties (manifests written by hand or by tools without a time).
    ts = manifest.get("timestamp") or {}
    created = manifest.get("created_unix")
    return (
        created if isinstance(created, (int, float)) else 0.0,
        ts.get("batch", 0),
        ts.get("epoch", 0),
        ts.get("sample", 0),
    )


def find_latest(folder: Any) -> Any:
    found = list_checkpoints(folder)
    return found[-1][0] if found else None


def remove_checkpoint(path: Any) -> None:
    """Delete a checkpoint so that a crash mid-delete leaves debris, not a half checkpoint (renamed
    to a temporary name first, or on object stores its manifest removed first)."""
    path = as_path(path)
    storage_of(path).remove_checkpoint(path)


def check_num_checkpoints_to_keep(keep: Any, name: str = "num_checkpoints_to_keep") -> int:
    """The retention count's rule: -1 (keep all) or an int >= 1; ``name`` is the argument's name."""
    if isinstance(keep, bool) or not isinstance(keep, int) or not (keep == -1 or keep >= 1):
        raise ValueError(f"{name}={keep!r} must be -1 (keep all) or an int >= 1")
    return keep


def apply_retention(folder: Any, keep: int, protect: Iterable[str] = ()) -> list[str]:
    """Keep the ``keep`` most recently saved checkpoints plus whatever ``last``/``best`` point to; -1 keeps all.

    The whole folder counts, checkpoints of earlier runs included, so a folder holds at most
    ``keep`` checkpoints (plus ``best``) once a save's retention has run, and ``keep + 1`` in the
    moment between a commit and its retention (all a crash can leave, besides ``*.tmp-*`` debris).
    """
    if keep < 0:
        return []
    folder = as_path(folder)
    protected = {link_target(folder, link) for link in LINKS} | set(protect)
    found = [path for path, _ in list_checkpoints(folder)]
    doomed = [path for path in found[: max(0, len(found) - keep)] if path.name not in protected]
    for path in doomed:
        remove_checkpoint(path)
    return [path.name for path in doomed]


def cleanup_temporary(folder: Any, keep: Iterable[str] = ()) -> list[str]:
    """Remove the debris of interrupted saves, links and deletes (except names in ``keep``): ``*.tmp-*``
    entries, and on object stores folders of save files that never got their manifest."""
    folder = as_path(folder)
    return storage_of(folder).cleanup(folder, set(keep))


def resolve_checkpoint(
    folder: Any, path: Any, must_exist: bool = True, storage_options: Mapping[str, Any] | None = None
) -> Any:
    """The checkpoint folder that ``path`` names (a ``pathlib.Path``, or a RemotePath for a URL).

    ``path`` is a checkpoint folder, ``"last"``/``"best"`` (inside ``folder``), or a save folder
    (then its ``last``). A ``last`` that is missing or points at an incomplete checkpoint (a crash
    between commit and link update) falls back to the most recently saved complete checkpoint. Returns
    None when nothing is found and ``must_exist`` is False. ``storage_options`` go to the fsspec
    filesystem of a URL.
    """
    if path is None:
        return None
    if not isinstance(path, RemotePath) and str(path) in LINKS and folder is not None:
        path = as_path(folder, storage_options) / str(path)
    else:
        path = as_path(path, storage_options)
    if path.is_dir() and not (path / MANIFEST).exists() and (path / "last").exists():
        path = path / "last"  # a save folder: its latest checkpoint
    link = path.name if path.name in LINKS else None
    if link is not None and not storage_of(path).renames:  # a pointer object: the checkpoint it names
        target = link_target(path.parent, link)
        path = path.parent / target if target is not None else path
    if link == "last" and not (path / MANIFEST).is_file():
        latest = find_latest(path.parent)
        if latest is not None:
            warnings.warn(
                f"{path} is missing or incomplete; using the most recently saved complete checkpoint {latest}",
                KilnWarning,
                stacklevel=2,
            )
            return latest.resolve()
    if not path.exists():
        if not must_exist:
            return None
        raise CheckpointError(
            path, "does not exist", "check the path, or pass autoresume=True to start fresh when there is none"
        )
    return path.resolve()  # a link resolved now keeps pointing at this checkpoint while it loads
