"""The three save types: which files a checkpoint folder holds and how they are written and read.

``sharded``  torch.distributed.checkpoint (DCP): every rank writes its own shards in parallel
             (``__<rank>_0.distcp``, ``.metadata``); replicated tensors (DDP) are spread over the
             ranks so each writes a part. Loads on any world size and any strategy.
``deduped``  the same DCP files, but each replicated tensor is written once, by the lowest rank
             that holds it: under DDP rank 0 writes the model and optimizer, the other ranks only
             their own training state. Fewer, fuller files; same loading.
``merged``   one consolidated ``checkpoint.pt`` (full model, optimizer keyed by parameter name,
             every rank's training state), written by rank 0; ``torch.load(..., weights_only=True)``
             opens it with no process group.

All types also hold each rank's training state (RNG, sampler, timestamp, ...): ``rank<r>.pt`` for
the DCP types, inside ``checkpoint.pt`` for ``merged``.
"""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch

from kiln.checkpoint import collectives
from kiln.checkpoint.errors import CheckpointError
from kiln.checkpoint.layout import write_durably
from kiln.checkpoint.serialization import SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata, safe_torch_load
from kiln.checkpoint.state import (load_model_optimizer_state, model_optimizer_state, restore_training_state,
                                   serialize_training_state)

__all__ = ["SAVE_TYPES", "MERGED_FILE", "training_state_file", "write_checkpoint_files", "read_checkpoint_files"]

SAVE_TYPES = ("sharded", "deduped", "merged")

# DCP warns on every single-process save and load that it "assumes the intent" is one process;
# in a world of one that is exactly kiln's intent. A filter (not catch_warnings, which is not
# thread-safe) because async saves call DCP from a background thread.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)
MERGED_FILE = "checkpoint.pt"
_WRITE_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))


def training_state_file(rank: int) -> str:
    return f"rank{rank}.pt"


def check_save_type(save_type: str) -> str:
    if save_type not in SAVE_TYPES:
        raise ValueError(f"save_type={save_type!r} is not known; expected one of {', '.join(SAVE_TYPES)}")
    return save_type


# -- writing ------------------------------------------------------------------------------------
def dcp_writer_and_planner(folder: Path, save_type: str) -> tuple[Any, Any]:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    # sync_files: each rank fsyncs what it wrote before DCP reports it done, so the commit that
    # follows never publishes bytes still in a page cache.
    # thread_count: a rank writes (and later hashes) a few files at once, which keeps fast disks busy.
    writer = FileSystemWriter(folder, single_file_per_rank=True, sync_files=True, overwrite=True,
                              thread_count=_WRITE_THREADS)
    return writer, DefaultSavePlanner(dedup_save_to_lowest_rank=save_type == "deduped")


def write_checkpoint_files(folder: Path, state: Any, save_type: str, asynchronous: bool = False,
                           group: Any = None) -> Any:
    """Write this rank's part of a checkpoint into ``folder`` (every rank calls this).

    ``asynchronous`` (DCP types only): the tensors are copied to CPU memory now and written in the
    background, coordinating over ``group``; the DCP future is returned. Otherwise returns None
    once everything is on disk.
    """
    from torch.distributed.checkpoint import async_save, save

    rank, world = collectives.rank_and_world()
    training_state = serialize_training_state(state)
    if save_type == "merged":
        _write_merged(folder, state, training_state, rank)
        return None
    write_durably(folder / training_state_file(rank), training_state)
    tensors = model_optimizer_state(state)
    writer, planner = dcp_writer_and_planner(folder, save_type)
    if asynchronous:
        return async_save(tensors, storage_writer=writer, planner=planner, process_group=group, no_dist=world == 1)
    save(tensors, storage_writer=writer, planner=planner, no_dist=world == 1)
    return None


def _write_merged(folder: Path, state: Any, training_state: bytes, rank: int) -> None:
    # Full state dicts are a collective under FSDP and ZeRO: every rank takes part, rank 0 writes.
    tensors = model_optimizer_state(state, full=True)
    everyone = collectives.all_gather_object(training_state)
    if rank != 0:
        return
    merged = {"model": tensors["model"], "optimizer": tensors.get("optimizer"),
              "ranks": [torch.load(io.BytesIO(b), weights_only=True) for b in everyone]}
    with open(folder / MERGED_FILE, "wb") as f:  # straight to the file: no second copy in memory
        torch.save(merged, f)
        f.flush()
        os.fsync(f.fileno())


# -- reading ------------------------------------------------------------------------------------
def read_checkpoint_files(path: Path, manifest: Mapping[str, Any], state: Any, strict: bool = True,
                          restore_rng: bool = True) -> None:
    """Load the checkpoint folder ``path`` into ``state`` (every rank calls this)."""
    rank, world = collectives.rank_and_world()
    saved_world = int(manifest.get("world_size", 1))
    if manifest["save_type"] == "merged":
        merged = safe_torch_load(path / MERGED_FILE, mmap=True)
        if not isinstance(merged, dict) or "model" not in merged:
            raise CheckpointError(path / MERGED_FILE, "is not a kiln merged checkpoint (no 'model' entry)")
        tensors = {"model": merged["model"], "optimizer": merged.get("optimizer")}
        target = _check_shapes(path / MERGED_FILE, _flat_shapes(tensors), state, strict, tensors["optimizer"] is not None)
        _fill_from_full(target, tensors)
        load_model_optimizer_state(state, target, strict=strict)
        ranks = merged.get("ranks") or []
        training, source = (ranks[rank] if rank < len(ranks) else ranks[0]), str(path / MERGED_FILE)
    else:
        metadata = read_dcp_metadata(path)
        shapes = {k: tuple(md.size) for k, md in metadata.state_dict_metadata.items() if hasattr(md, "size")}
        has_optimizer = any(k.startswith("optimizer.") for k in metadata.state_dict_metadata)
        target = _check_shapes(path / ".metadata", shapes, state, strict, has_optimizer)
        _dcp_load(path, target, strict, world)
        load_model_optimizer_state(state, target, strict=strict)
        own = path / training_state_file(rank)
        file = own if own.exists() else path / training_state_file(0)
        training, source = safe_torch_load(file), str(file)
    same_rank = rank < saved_world and world == saved_world
    if restore_rng and not same_rank:
        warnings.warn(f"{path} was saved by {saved_world} rank(s) and is loaded by {world}; RNG states are not "
                      "restored, so the resumed run is not bit-exact", stacklevel=3)
    restore_training_state(state, training, source, restore_rng=restore_rng and same_rank,
                           same_world=world == saved_world)


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
                shard = distribute_tensor(value.to(current.device, current.dtype), current.device_mesh,
                                          current.placements, src_data_rank=None)
                current.to_local().copy_(shard.to_local())
            elif isinstance(current, torch.Tensor):
                current.copy_(value)
            else:
                values[key] = value


def _dcp_load(path: Path, target: dict[str, Any], strict: bool, world: int) -> None:
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        load(target, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(allow_partial_load=not strict),
             no_dist=world == 1)
    except CheckpointError:
        raise
    except CheckpointException as exc:  # DCP wraps each rank's failure; report the first one plainly
        failures = getattr(exc, "failures", {}) or {}
        first = next(iter(failures.values()), exc)
        inner = getattr(first, "args", [first])
        if inner and isinstance(inner[0], CheckpointError):
            raise inner[0] from None
        raise CheckpointError(path, f"could not be read ({type(first).__name__}: {str(first).splitlines()[0][:300]})",
                              "run `kiln checkpoint verify` on it; load an earlier checkpoint") from None
    except (RuntimeError, ValueError, KeyError, EOFError, OSError) as exc:
        raise CheckpointError(path, f"could not be read ({type(exc).__name__}: {str(exc).splitlines()[0][:300]})",
                              "run `kiln checkpoint verify` on it; load an earlier checkpoint") from None


def _flat_shapes(tensors: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict({k: v for k, v in tensors.items() if v is not None})
    return {k: tuple(v.shape) for k, v in flat.items() if isinstance(v, torch.Tensor)}


def _check_shapes(source: Path, saved: Mapping[str, tuple[int, ...]], state: Any, strict: bool,
                  has_optimizer: bool) -> dict[str, Any]:
    """The load target for ``state``, after checking the saved tensors fit it; one clear error if not.

    Shapes are global (a DTensor's ``.shape`` is the full shape), so this holds across strategies.
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    target = model_optimizer_state(state, with_optimizer=has_optimizer)
    flat, _ = flatten_state_dict(target)
    wanted = {k: tuple(v.shape) for k, v in flat.items() if isinstance(v, torch.Tensor)}
    wrong = [f"{k} is {list(saved[k])} in the checkpoint but {list(shape)} in the model"
             for k, shape in wanted.items() if k in saved and saved[k] != shape]
    problems = wrong[:]
    if strict:
        missing = [k for k in wanted if k not in saved]
        unexpected = [k for k in saved if k.startswith("model.") and k not in wanted]
        if missing:
            problems.append(f"{len(missing)} tensor(s) the model needs are not in the checkpoint ({', '.join(missing[:3])}"
                            + (", ..." if len(missing) > 3 else "") + ")")
        if unexpected:
            problems.append(f"{len(unexpected)} tensor(s) in the checkpoint are not in the model ({', '.join(unexpected[:3])}"
                            + (", ..." if len(unexpected) > 3 else "") + ")")
    if problems:
        more = f" (and {len(problems) - 2} more problems)" if len(problems) > 2 else ""
        raise CheckpointError(source, "does not fit this model: " + "; ".join(problems[:2]) + more,
                              "build the model as it was when saved (`kiln checkpoint inspect` lists the saved shapes)"
                              + ("" if wrong else ", or load with strict=False to skip missing and extra tensors"))
    return target
