"""The checkpoint folder on disk: names, atomic commit, manifest, links, retention, verification.

::

    save_folder/
      ep3-ba120/                 one checkpoint; written as ep3-ba120.tmp-<nonce>, renamed when complete
        manifest.json            written last: format version, timestamp, world size, save type,
                                 metrics, the sha256 and size of every other file, and the sha256
                                 of its own content (manifest_sha256)
        ...                      the files of the save type (see kiln.checkpoint.formats)
      last -> ep3-ba120          relative symlinks (a copy where links are impossible)
      best -> ep2-ba80

Everything here is plain filesystem work on one process; kiln.checkpoint.checkpointing decides
which rank does what. Crash safety comes from three rules: nothing without a manifest is a
checkpoint, a folder only gets its final name by one ``rename``, and links are replaced by one
``rename`` of a new link over the old one. A crash at any moment therefore leaves either the old
or the new state, plus ``*.tmp-*`` debris that is ignored and later removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kiln.checkpoint.errors import CheckpointError

__all__ = [
    "check_num_checkpoints_to_keep",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST",
    "MANIFEST_CHECKSUM",
    "LINKS",
    "checkpoint_name",
    "is_temporary",
    "temporary_name",
    "sha256_file",
    "write_durably",
    "fsync_dir",
    "list_files",
    "hash_files",
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
    "verify_files",
    "resolve_checkpoint",
]

FORMAT_NAME = "kiln-checkpoint"
FORMAT_VERSION = 1  # bump when a reader of the old version could not load the new layout
MANIFEST = "manifest.json"
MANIFEST_CHECKSUM = "manifest_sha256"
TMP = ".tmp-"
LINKS = ("last", "best")
_CHUNK = 16 << 20  # hashlib releases the GIL on large buffers, so big chunks also let training run


def checkpoint_name(epoch: int, batch: int) -> str:
    """``ep{epoch}-ba{batch}``: sorts by progress when read, names the resume point exactly."""
    return f"ep{int(epoch)}-ba{int(batch)}"


def is_temporary(name: str) -> bool:
    return TMP in name


def temporary_name(name: str, nonce: str | None = None) -> str:
    return f"{name}{TMP}{nonce or uuid.uuid4().hex[:12]}"


# -- durable files ------------------------------------------------------------------------------
def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def write_durably(path: str | os.PathLike, data: bytes) -> None:
    """Write and fsync: a rename that makes the folder visible must never expose unflushed bytes."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: str | os.PathLike) -> None:
    """Persist a folder's entries (new names, renames); a no-op where folders cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def list_files(root: str | os.PathLike) -> list[str]:
    """Every file under ``root`` except the manifest, as sorted relative POSIX paths."""
    root = Path(root)
    names = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
    return sorted(n for n in names if n != MANIFEST)


def hash_files(root: str | os.PathLike, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """sha256 and size of each file; files are hashed in parallel threads (hashlib releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    root, names = Path(root), list(names)
    workers = max(1, min(len(names), os.cpu_count() or 1, 8))
    with ThreadPoolExecutor(workers) as pool:
        digests = list(pool.map(lambda n: sha256_file(root / n), names))
    return {n: {"sha256": d, "bytes": (root / n).stat().st_size} for n, d in zip(names, digests)}


# -- manifest -----------------------------------------------------------------------------------
def write_manifest(folder: str | os.PathLike, manifest: dict[str, Any]) -> None:
    """Write ``folder/manifest.json`` with its own checksum (any earlier one is replaced)."""
    plain = json.loads(json.dumps({k: v for k, v in manifest.items() if k != MANIFEST_CHECKSUM}, default=_json_default))
    plain[MANIFEST_CHECKSUM] = _manifest_digest(plain)
    write_durably(Path(folder) / MANIFEST, json.dumps(plain, indent=2, sort_keys=True).encode())
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


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the checkpoint folder ``path``; a CheckpointError if it is not a complete one."""
    path = Path(path)
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
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
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


def verify_files(
    path: str | os.PathLike, manifest: dict[str, Any], names: Iterable[str] | None = None, checksums: bool = True
) -> None:
    """Check that each listed file exists with its recorded size (and sha256); raise naming the first bad one."""
    path = Path(path)
    files = manifest["files"]
    for name in sorted(files) if names is None else names:
        record = files[name]
        file = path / name
        if ".." in Path(name).parts or Path(name).is_absolute():
            raise CheckpointError(path / MANIFEST, f"lists a file outside the checkpoint: {name!r}")
        if not file.is_file():
            raise CheckpointError(
                file, "is missing", "the checkpoint was copied incompletely; copy it again or load another"
            )
        size = file.stat().st_size
        if size != record.get("bytes"):
            raise CheckpointError(
                file,
                f"is truncated or altered: {size} bytes, the manifest says {record.get('bytes')}",
                "the copy or download was cut short; copy it again or load another checkpoint",
            )
        if checksums and sha256_file(file) != record.get("sha256"):
            raise CheckpointError(
                file,
                "is corrupt: its sha256 does not match the manifest",
                "the file was damaged on disk or in transfer; copy it again or load another checkpoint",
            )


# -- commit and links ---------------------------------------------------------------------------
def commit(tmp_dir: str | os.PathLike, final_dir: str | os.PathLike) -> Path:
    """Give a finished temporary folder its final name with one atomic rename.

    An existing checkpoint of the same name (a run that resumed and saved the same step again) is
    first renamed to a temporary name, so the old one stays whole until the new one is in place.
    """
    tmp_dir, final_dir = Path(tmp_dir), Path(final_dir)
    old = None
    if final_dir.is_dir() and not final_dir.is_symlink():
        old = final_dir.with_name(temporary_name(final_dir.name, "old-" + uuid.uuid4().hex[:8]))
        os.rename(final_dir, old)
    os.rename(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final_dir


def update_link(folder: str | os.PathLike, link: str, target: str) -> None:
    """Point ``folder/link`` at ``folder/target`` atomically: a relative symlink, else a copy."""
    folder = Path(folder)
    dst = folder / link
    tmp = folder / temporary_name(link)
    try:
        os.symlink(target, tmp, target_is_directory=True)  # relative: the run folder stays movable
    except (OSError, NotImplementedError):
        shutil.copytree(folder / target, tmp, symlinks=True)  # filesystems without links
    old = None
    new_is_link = tmp.is_symlink()
    if (dst.is_dir() and not dst.is_symlink()) or (dst.is_symlink() and not new_is_link):
        # rename cannot put a link over a folder or a folder over a link: move the old one aside
        # (for a moment there is no `last`; resolve_checkpoint then falls back to the newest)
        old = folder / temporary_name(link, "old-" + uuid.uuid4().hex[:8])
        os.rename(dst, old)
    os.replace(tmp, dst)
    fsync_dir(folder)
    if old is not None and old.is_symlink():
        old.unlink()
    elif old is not None:
        shutil.rmtree(old, ignore_errors=True)


def link_target(folder: str | os.PathLike, link: str) -> str | None:
    """The name of the checkpoint ``folder/link`` stands for (a link's target, or a copy's own name)."""
    dst = Path(folder) / link
    if dst.is_symlink():
        return Path(os.readlink(dst)).name
    if dst.is_dir():
        try:
            return str(json.loads((dst / MANIFEST).read_text()).get("name"))
        except (OSError, ValueError):
            return None
    return None


# -- the set of checkpoints ---------------------------------------------------------------------
def list_checkpoints(folder: str | os.PathLike) -> list[tuple[Path, dict[str, Any]]]:
    """Complete checkpoints in ``folder`` (not links, not temporaries), in the order they were saved.

    Save order, not training progress: a run started again from scratch, or from an earlier
    checkpoint, writes checkpoints of less progress than the previous run left there, and those
    are the newer ones (``last`` points at them). Ordering by progress made retention delete the
    new run's checkpoints and keep the stale ones, and the ``last`` fallback pick a stale one.
    """
    folder = Path(folder)
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


def find_latest(folder: str | os.PathLike) -> Path | None:
    found = list_checkpoints(folder)
    return found[-1][0] if found else None


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Delete a checkpoint; renamed first, so a crash mid-delete leaves temporary debris, not a half checkpoint."""
    path = Path(path)
    doomed = path.with_name(temporary_name(path.name, "del-" + uuid.uuid4().hex[:8]))
    os.rename(path, doomed)
    fsync_dir(path.parent)
    shutil.rmtree(doomed, ignore_errors=True)


def check_num_checkpoints_to_keep(keep: Any, name: str = "num_checkpoints_to_keep") -> int:
    """The retention count's rule: -1 (keep all) or an int >= 1; ``name`` is the argument's name."""
    if isinstance(keep, bool) or not isinstance(keep, int) or not (keep == -1 or keep >= 1):
        raise ValueError(f"{name}={keep!r} must be -1 (keep all) or an int >= 1")
    return keep


def apply_retention(folder: str | os.PathLike, keep: int, protect: Iterable[str] = ()) -> list[str]:
    """Keep the ``keep`` most recently saved checkpoints plus whatever ``last``/``best`` point to; -1 keeps all.

    The whole folder counts, checkpoints of earlier runs included, so a folder holds at most
    ``keep`` checkpoints (plus ``best``) once a save's retention has run, and ``keep + 1`` in the
    moment between a commit and its retention (all a crash can leave, besides ``*.tmp-*`` debris).
    """
    if keep < 0:
        return []
    protected = {link_target(folder, link) for link in LINKS} | set(protect)
    found = [path for path, _ in list_checkpoints(folder)]
    doomed = [path for path in found[: max(0, len(found) - keep)] if path.name not in protected]
    for path in doomed:
        remove_checkpoint(path)
    return [path.name for path in doomed]


def cleanup_temporary(folder: str | os.PathLike, keep: Iterable[str] = ()) -> list[str]:
    """Remove ``*.tmp-*`` debris of interrupted saves, links and deletes (except names in ``keep``)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    keep = set(keep)
    removed = []
    for entry in folder.iterdir():
        if not is_temporary(entry.name) or entry.name in keep:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry.name)
    return removed


def resolve_checkpoint(
    folder: str | os.PathLike | None, path: str | os.PathLike | None, must_exist: bool = True
) -> Path | None:
    """The checkpoint folder that ``path`` names.

    ``path`` is a checkpoint folder, ``"last"``/``"best"`` (inside ``folder``), or a save folder
    (then its ``last``). A ``last`` that is missing or points at an incomplete checkpoint (a crash
    between commit and link update) falls back to the most recently saved complete checkpoint. Returns
    None when nothing is found and ``must_exist`` is False.
    """
    if path is None:
        return None
    path = Path(path)
    if str(path) in LINKS and folder is not None:
        path = Path(folder) / path
    if path.is_dir() and not (path / MANIFEST).exists() and (path / "last").exists():
        path = path / "last"  # a save folder: its latest checkpoint
    if path.name == "last" and not (path / MANIFEST).is_file():
        latest = find_latest(path.parent)
        if latest is not None:
            warnings.warn(
                f"{path} is missing or incomplete; using the most recently saved complete checkpoint {latest}",
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
