"""The three save types: which files a checkpoint folder holds and how they are written and read.

``sharded``  torch.distributed.checkpoint (DCP): every rank writes its own shards in parallel
             (``__<rank>_0.distcp``, ``.metadata``); replicated tensors (DDP) are spread over the
             ranks so each writes a part. Loads on any world size and any strategy.
``deduped``  the same DCP files, but each replicated tensor is written once, by the lowest rank
             that holds it: under DDP rank 0 writes the model and optimizer, the other ranks only
             their own training state. Fewer, fuller files; same loading.
``merged``   one consolidated ``checkpoint.pt`` (full model, optimizer keyed by parameter name,
             every rank's training state), written by rank 0; ``torch.load(..., weights_only=True)``
             opens it with no process group. ``kiln checkpoint merge SRC DST.pt`` writes the same
             dictionary as one file outside any folder, with the manifest inside it (``"manifest"``,
             without the file checksums a single file cannot carry); it loads like a folder.

All types also hold each rank's training state (RNG, loader position, timestamp, ...): ``rank<r>.pt`` for
the DCP types, inside ``checkpoint.pt`` for ``merged``.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kiln.checkpoint import collectives
from kiln.checkpoint.errors import CheckpointError
from kiln.checkpoint.hashing import HashingStream, WriteLog, checksum_bytes, record, record_writes
from kiln.checkpoint.layout import check_manifest
from kiln.checkpoint.serialization import (
    SafeLoadPlanner,
    dcp_failure,
    dcp_reader,
    read_dcp_metadata,
    safe_torch_load,
)
from kiln.checkpoint.staging import staging_buffers_for
from kiln.checkpoint.state import (
    load_model_optimizer_state,
    model_optimizer_state,
    restore_training_state,
    serialize_training_state,
    training_objects,
)
from kiln.checkpoint.storage import as_path, storage_of
from kiln.core.warn import KilnWarning

__all__ = [
    "SAVE_TYPES",
    "MERGED_FILE",
    "MERGED_SUFFIXES",
    "training_state_file",
    "write_checkpoint_files",
    "read_checkpoint_files",
    "read_merged",
    "read_merged_file",
    "read_training_state",
]

SAVE_TYPES = ("sharded", "deduped", "merged")

# DCP warns on every single-process save and load that it "assumes the intent" is one process;
# in a world of one that is exactly kiln's intent. A filter (not catch_warnings, which is not
# thread-safe) because async saves call DCP from a background thread.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized", category=UserWarning
)
MERGED_FILE = "checkpoint.pt"
MERGED_SUFFIXES = (".pt", ".pth")  # a checkpoint that is one file (kiln checkpoint merge SRC DST.pt)
# Files each rank writes at once (and so hashes at once): two keep a disk busy while a core hashes
# and serializes; object stores get more, each upload mostly waiting on the network.
_WRITE_THREADS = max(2, min(4, (os.cpu_count() or 1) // 2))
_UPLOAD_THREADS = 4


def training_state_file(rank: int) -> str:
    return f"rank{rank}.pt"


def check_save_type(save_type: str) -> str:
    if save_type not in SAVE_TYPES:
        raise ValueError(f"save_type={save_type!r} is not known; expected one of {', '.join(SAVE_TYPES)}")
    return save_type


# -- writing ------------------------------------------------------------------------------------
def dcp_writer_and_planner(folder: Any, save_type: str) -> tuple[Any, Any]:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    folder = as_path(folder)
    storage = storage_of(folder)
    # thread_count: a rank writes (and hashes, see kiln.checkpoint.hashing) a few files at once.
    writer = storage.dcp_writer(folder, _WRITE_THREADS if storage.renames else _UPLOAD_THREADS)
    return writer, DefaultSavePlanner(dedup_save_to_lowest_rank=save_type == "deduped")


def write_checkpoint_files(
    folder: Any, state: Any, save_type: str, asynchronous: bool = False, group: Any = None
) -> tuple[Any, WriteLog]:
    """Write this rank's part of a checkpoint into ``folder`` (every rank calls this).

    Returns ``(future, log)``: the log holds the checksum and size of each file this rank wrote,
    taken while writing, and any failure (see :class:`kiln.checkpoint.hashing.WriteLog`).
    ``asynchronous`` (DCP types only): the tensors are copied to CPU memory now and written in
    the background, coordinating over ``group``; the DCP future is returned, and the log is
    complete once it is done. Otherwise the future is None and everything is written.
    """
    from torch.distributed.checkpoint import async_save, save
    from torch.distributed.checkpoint.api import CheckpointException

    folder = as_path(folder)
    rank, world = collectives.rank_and_world()
    training_state = serialize_training_state(state)
    log = WriteLog()
    if save_type == "merged":
        _write_merged(folder, state, training_state, rank, log)
        return None, log
    name = training_state_file(rank)
    storage_of(folder).write_durably(folder / name, training_state)
    log.add(name, record(checksum_bytes(training_state), len(training_state)))
    tensors = model_optimizer_state(state)
    writer, planner = dcp_writer_and_planner(folder, save_type)
    record_writes(writer, log)
    if asynchronous:
        # Staged into host buffers this model's earlier saves used (pinned for GPU tensors);
        # they go back to the pool when the write is done (kiln.checkpoint.staging).
        buffers = staging_buffers_for(training_objects(state)[0])
        future = async_save(
            tensors,
            storage_writer=writer,
            planner=planner,
            process_group=group,
            no_dist=world == 1,
            async_stager=buffers,
        )
        buffers.release_when_done(future)
        return future, log
    try:
        save(tensors, storage_writer=writer, planner=planner, no_dist=world == 1)
    except CheckpointException:  # DCP's wrapper (a BaseException) of a failure the log holds as raised
        log.check()
        raise
    log.check()  # a failure in one of DCP's writer threads, which DCP itself drops
    return None, log


def _write_merged(folder: Any, state: Any, training_state: bytes, rank: int, log: WriteLog) -> None:
    # Full state dicts are a collective under FSDP and ZeRO: every rank takes part, rank 0 writes.
    tensors = model_optimizer_state(state, full=True)
    everyone = collectives.all_gather_object(training_state)
    if rank != 0:
        return
    merged = {
        "model": tensors["model"],
        "optimizer": tensors.get("optimizer"),
        "ranks": [torch.load(io.BytesIO(b), weights_only=True) for b in everyone],
    }
    file = folder / MERGED_FILE
    local = isinstance(file, Path)
    with open(file, "wb") if local else file.open("wb") as f:  # straight to the file: no second copy in memory
        stream = HashingStream(f, MERGED_FILE)
        torch.save(merged, stream)  # type: ignore[arg-type]  # a write-only stream is all torch.save needs
        f.flush()
        if local:
            os.fsync(f.fileno())
    log.add(MERGED_FILE, stream.record())


# -- reading ------------------------------------------------------------------------------------
def read_merged(file: Any) -> dict[str, Any]:
    """A merged checkpoint's dictionary (``checkpoint.pt`` or a merged file), its structure checked."""
    return _check_merged(file, safe_torch_load(file, mmap=True))


def _check_merged(file: Any, merged: Any) -> dict[str, Any]:
    if not isinstance(merged, dict) or not isinstance(merged.get("model"), dict):
        raise CheckpointError(
            file,
            "is not a kiln merged checkpoint (no 'model' dictionary)",
            "pass a checkpoint written by kiln (a folder, or a file from `kiln checkpoint merge`)",
        )
    if not isinstance(merged.get("optimizer"), (dict, type(None))):
        raise CheckpointError(
            file, f"is damaged: its 'optimizer' is a {type(merged['optimizer']).__name__}, not a dictionary"
        )
    ranks = merged.get("ranks")
    if not isinstance(ranks, list) or not ranks or not all(isinstance(r, dict) for r in ranks):
        raise CheckpointError(file, "is damaged: 'ranks' is not a list of each rank's training state")
    return merged


def read_merged_file(file: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(manifest, merged)`` of a checkpoint that is one ``.pt``/``.pth`` file."""
    if file.suffix not in MERGED_SUFFIXES:
        raise CheckpointError(
            file,
            "is a file, not a checkpoint folder",
            "pass the folder that holds manifest.json, or a .pt/.pth file from `kiln checkpoint merge` "
            "(use `kiln checkpoint inspect` to look inside)",
        )
    merged = safe_torch_load(file, mmap=True)
    if not isinstance(merged, dict) or "manifest" not in merged:
        raise CheckpointError(
            file,
            "has no 'manifest' entry, so it is not a checkpoint file written by kiln",
            "write one with `kiln checkpoint merge SRC DST.pt`",
        )
    manifest = merged["manifest"]
    check_manifest(file, manifest)
    _check_merged(file, merged)
    if manifest.get("save_type") != "merged":
        raise CheckpointError(file, f"has save_type {manifest.get('save_type')!r} in its manifest; a file is 'merged'")
    return manifest, merged


def read_training_state(file: Any) -> dict[str, Any]:
    training = safe_torch_load(file)
    if not isinstance(training, dict):
        raise CheckpointError(file, f"is damaged: it holds a {type(training).__name__}, not a rank's training state")
    return training


def read_checkpoint_files(
    path: Any,
    manifest: Mapping[str, Any],
    state: Any,
    strict: bool = True,
    restore_rng: bool = True,
    merged: dict[str, Any] | None = None,
    checksums: Any = None,
) -> None:
    """Load the checkpoint ``path`` (a folder, or a merged file whose dictionary is ``merged``) into
    ``state`` (every rank calls this). ``checksums``: the PendingChecksums of the ``.distcp`` files
    (see :func:`kiln.checkpoint.checkpointing.load_checkpoint`), awaited before the state changes."""
    rank, world = collectives.rank_and_world()
    saved_world = int(manifest.get("world_size", 1))
    if manifest["save_type"] == "merged":
        file = path if path.is_file() else path / MERGED_FILE
        merged = read_merged(file) if merged is None else merged
        tensors = {"model": merged["model"], "optimizer": merged.get("optimizer")}
        target = _check_shapes(
            file, _guarded(file, _flat_shapes, tensors), state, strict, tensors["optimizer"] is not None
        )
        _guarded(file, _fill_from_full, target, tensors)
        load_model_optimizer_state(state, target, strict=strict)
        ranks = merged["ranks"]
        training, source = (ranks[rank] if rank < len(ranks) else ranks[0]), str(file)
    else:
        metadata = read_dcp_metadata(path)
        shapes = {k: tuple(md.size) for k, md in metadata.state_dict_metadata.items() if hasattr(md, "size")}
        has_optimizer = any(k.startswith("optimizer.") for k in metadata.state_dict_metadata)
        target = _check_shapes(path / ".metadata", shapes, state, strict, has_optimizer)
        _dcp_load(path, target, strict, world, checksums, metadata)
        load_model_optimizer_state(state, target, strict=strict)
        own = path / training_state_file(rank)
        file = own if own.exists() else path / training_state_file(0)
        training, source = read_training_state(file), str(file)
    same_rank = rank < saved_world and world == saved_world
    if restore_rng and not same_rank:
        warnings.warn(
            f"{path} was saved by {saved_world} rank(s) and is loaded by {world}; RNG states are not "
            "restored, so the resumed run is not bit-exact",
            KilnWarning,
            stacklevel=3,
        )
    _guarded(
        source,
        restore_training_state,
        state,
        training,
        source,
        restore_rng=restore_rng and same_rank,
        same_world=world == saved_world,
    )


def _guarded(source: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args)``, with any failure other than a CheckpointError reported as one naming ``source``.

    A file whose bytes unpickle can still hold content that does not fit: damage that happens to
    unpickle (a renamed key), or a run that changed since the save (a callback's ``load_state_dict``
    refusing its old state). Either way the user needs the file's name, not a traceback.
    """
    try:
        return fn(*args, **kwargs)
    except CheckpointError:
        raise
    except Exception as exc:
        text = str(exc).strip().splitlines()
        raise CheckpointError(
            source,
            f"could not be applied to this run ({type(exc).__name__}: {text[0][:300] if text else ''})",
            "the file is damaged, or the run differs from the one that saved it (model, "
            "schedulers, callbacks); load an earlier checkpoint or build the run as it was saved",
        ) from None


def _fill_from_full(target: dict[str, Any], full: Mapping[str, Any]) -> None:
    """Copy whole saved tensors into the (possibly sharded) load target, each rank keeping its part.

    torch's ``set_state_dict(full_state_dict=True)`` cannot take the flattened optimizer form, so
    the merged tensors are cut to the target's placements here; ``src_data_rank=None`` makes every
    rank cut its own shard from its own copy, with no communication.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    for section, values in target.items():
        saved = full.get(section) or {}
        for key, current in values.items():
            if key not in saved:
                continue  # allowed only with strict=False; _check_shapes has said so otherwise
            value = saved[key]
            if isinstance(current, DTensor):
                shard = distribute_tensor(
                    value.to(current.device, current.dtype), current.device_mesh, current.placements, src_data_rank=None
                )
                current.to_local().copy_(shard.to_local())
            elif isinstance(current, torch.Tensor):
                current.copy_(value)
            else:
                values[key] = value


def _dcp_load(
    path: Any, target: dict[str, Any], strict: bool, world: int, checksums: Any = None, metadata: Any = None
) -> None:
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.api import CheckpointException

    reader = dcp_reader(path)
    reader.checksums = checksums
    reader.known_metadata = metadata
    try:
        load(
            target,
            storage_reader=reader,
            planner=SafeLoadPlanner(allow_partial_load=not strict),
            no_dist=world == 1,
        )
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP wraps each rank's failure in a BaseException
        raise dcp_failure(exc, path) from None


def _flat_shapes(tensors: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict({k: v for k, v in tensors.items() if v is not None})
    return {k: tuple(v.shape) for k, v in flat.items() if isinstance(v, torch.Tensor)}


def _check_shapes(
    source: Any, saved: Mapping[str, tuple[int, ...]], state: Any, strict: bool, has_optimizer: bool
) -> dict[str, Any]:
    """The load target for ``state``, after checking the saved tensors fit it; one clear error if not.

    Shapes are global (a DTensor's ``.shape`` is the full shape), so this holds across strategies.
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    target = model_optimizer_state(state, with_optimizer=has_optimizer)
    flat, _ = flatten_state_dict(target)
    wanted = {k: tuple(v.shape) for k, v in flat.items() if isinstance(v, torch.Tensor)}
    wrong = [
        f"{k} is {list(saved[k])} in the checkpoint but {list(shape)} in the model"
        for k, shape in wanted.items()
        if k in saved and saved[k] != shape
    ]
    problems = wrong[:]
    if strict:
        missing = [k for k in wanted if k not in saved]
        unexpected = [k for k in saved if k.startswith("model.") and k not in wanted]
        if missing:
            problems.append(
                f"{len(missing)} tensor(s) the model needs are not in the checkpoint ({', '.join(missing[:3])}"
                + (", ..." if len(missing) > 3 else "")
                + ")"
            )
        if unexpected:
            problems.append(
                f"{len(unexpected)} tensor(s) in the checkpoint are not in the model ({', '.join(unexpected[:3])}"
                + (", ..." if len(unexpected) > 3 else "")
                + ")"
            )
    if problems:
        more = f" (and {len(problems) - 2} more problems)" if len(problems) > 2 else ""
        raise CheckpointError(
            source,
            "does not fit this model: " + "; ".join(problems[:2]) + more,
            "build the model as it was when saved (`kiln checkpoint inspect` lists the saved shapes)"
            + ("" if wrong else ", or load with strict=False to skip missing and extra tensors"),
        )
    return target
