"""Working on checkpoint folders with no process group and no model: inspect, merge, export.

These back ``kiln checkpoint inspect|merge|export``; they read sharded checkpoints whole with
DCP's no-model planner (in its safe form) and never unpickle code. Each accepts a checkpoint
folder or a merged ``.pt``/``.pth`` file, on the local disk or at an fsspec URL (``s3://...``,
with the filesystem's options from the environment).
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kiln.checkpoint import layout, verification
from kiln.checkpoint.checkpointing import verify_checkpoint
from kiln.checkpoint.errors import CheckpointError
from kiln.checkpoint.formats import (
    MERGED_FILE,
    MERGED_SUFFIXES,
    _flat_shapes,
    read_merged,
    read_merged_file,
    read_training_state,
    training_state_file,
)
from kiln.checkpoint.serialization import SafeEmptyLoadPlanner, dcp_failure, dcp_reader, read_dcp_metadata
from kiln.checkpoint.storage import as_path, storage_of
from kiln.precision import DTYPES

__all__ = ["load_full", "inspect_checkpoint", "format_inspection", "merge_checkpoint", "export_safetensors"]


def load_full(path: Any, model_only: bool = False) -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
    """``(manifest, {"model": ..., "optimizer": ...}, [training state of each rank])``, all full tensors on CPU."""
    # DCP's public load() only fills keys the caller's dict already has; the private loader is
    # what DCP's own dcp_to_torch_save uses to rebuild a whole state dict from the metadata.
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = _checkpoint(path)
    manifest = verify_checkpoint(path)
    if manifest["save_type"] == "merged":
        merged = read_merged_file(path)[1] if path.is_file() else read_merged(path / MERGED_FILE)
        return manifest, {"model": merged["model"], "optimizer": merged.get("optimizer")}, list(merged["ranks"])
    tensors: dict[str, Any] = {}
    planner = SafeEmptyLoadPlanner(keys={"model"} if model_only else None)
    try:
        _load_state_dict(tensors, storage_reader=dcp_reader(path), planner=planner, no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP wraps failures in a BaseException
        raise dcp_failure(exc, path) from None
    ranks = (
        [
            read_training_state(path / training_state_file(r))
            for r in range(int(manifest.get("world_size", 1)))
            if (path / training_state_file(r)).exists()
        ]
        if not model_only
        else []
    )
    return manifest, {"model": tensors.get("model", {}), "optimizer": tensors.get("optimizer")}, ranks


def _checkpoint(path: Any) -> Any:
    """``path`` as a kiln path, a ``last``/``best`` pointer object on an object store followed."""
    path = as_path(path)
    if path.name in layout.LINKS and not storage_of(path).renames:
        path = layout.resolve_checkpoint(None, path)
    return path.resolve()


def inspect_checkpoint(path: Any) -> dict[str, Any]:
    """A summary of a checkpoint without loading its tensors: manifest, sizes, and every model tensor's shape.

    Example::

        info = kiln.checkpoint.inspect_checkpoint("runs/a/last")
        info["num_parameters"], info["timestamp"]["batch"]
    """
    path = _checkpoint(path)
    # Sizes and safe pickles, not the checksum of every file: a quick look still refuses a file
    # that is cut short or carries code (`kiln checkpoint verify` adds the checksums).
    manifest = verify_checkpoint(path, checksums=False)
    shapes: dict[str, tuple[list[int], str]] = {}
    optimizer_tensors = 0
    if manifest.get("save_type") == "merged":
        merged = read_merged_file(path)[1] if path.is_file() else read_merged(path / MERGED_FILE)
        shapes = {
            k: (list(v.shape), str(v.dtype).replace("torch.", ""))
            for k, v in merged["model"].items()
            if isinstance(v, torch.Tensor)
        }
        optimizer_tensors = len(_flat_shapes({"optimizer": merged.get("optimizer")}))
    else:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        for key, md in read_dcp_metadata(path).state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                continue
            if key.startswith("model."):
                shapes[key[len("model.") :]] = (list(md.size), str(md.properties.dtype).replace("torch.", ""))
            elif key.startswith("optimizer."):
                optimizer_tensors += 1
    num_parameters = sum(_numel(shape) for shape, _ in shapes.values())
    files = manifest.get("files") or {path.name: {"bytes": path.stat().st_size}}  # a merged file is its one file
    return {
        **{k: v for k, v in manifest.items() if k not in ("files", layout.MANIFEST_CHECKSUM)},
        "path": str(path),
        "num_files": len(files),
        "bytes": sum(int(f.get("bytes", 0)) for f in files.values()),
        "model": shapes,
        "num_parameters": num_parameters,
        "optimizer_tensors": optimizer_tensors,
    }


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def format_inspection(info: dict[str, Any], max_tensors: int = 40) -> str:
    ts = info.get("timestamp") or {}
    strategy = (info.get("strategy") or {}).get("name", "?")
    lines = [
        f"checkpoint  {info['path']}",
        f"type        {info['save_type']} (format {info['format_version']}, kiln {info.get('kiln_version')}, "
        f"torch {info.get('torch_version')})",
        f"created     {info.get('created')}",
        f"progress    epoch {ts.get('epoch', 0)}, batch {ts.get('batch', 0)}, sample {ts.get('sample', 0)}"
        f" ({ts.get('batch_in_epoch', 0)} batches into the epoch)",
        f"saved by    {info.get('world_size')} rank(s), strategy {strategy}, precision {info.get('precision')}",
        f"metrics     {', '.join(f'{k}={v:.6g}' for k, v in sorted((info.get('metrics') or {}).items())) or '-'}",
        f"files       {info['num_files']} files, {info['bytes'] / 1e6:.1f} MB",
        f"model       {len(info['model'])} tensors, {info['num_parameters']:,} parameters",
    ]
    for i, (name, (shape, dtype)) in enumerate(sorted(info["model"].items())):
        if i == max_tensors:
            lines.append(f"  ... and {len(info['model']) - max_tensors} more")
            break
        lines.append(f"  {name:<48} {str(shape):<20} {dtype}")
    lines.append(
        f"optimizer   {info['optimizer_tensors']} state tensors"
        if info["optimizer_tensors"]
        else "optimizer   none saved"
    )
    return "\n".join(lines)


def merge_checkpoint(src: Any, dst: Any) -> Any:
    """Write a checkpoint as a ``merged`` one at ``dst``: one file when ``dst`` ends in ``.pt`` or
    ``.pth``, else a checkpoint folder. Either is written under a temporary name and renamed when
    complete, and an existing ``dst`` is never overwritten.

    The file is a dictionary ``{"model", "optimizer", "ranks", "manifest"}`` that
    ``torch.load(dst, weights_only=True)`` opens, and that ``load_checkpoint``, ``kiln.Trainer(load_path=...)``
    and the other ``kiln checkpoint`` commands accept. It has no per-file checksums (the folder form
    has them in its manifest).

    Example::

        kiln.checkpoint.merge_checkpoint("runs/a/ep3-ba120", "exports/ep3-ba120.pt")
    """
    manifest, tensors, ranks = load_full(src)
    dst = as_path(dst)
    if dst.exists() or dst.is_symlink():
        raise CheckpointError(dst, "already exists", "choose a new destination or remove it first")
    merged = {
        **{k: v for k, v in manifest.items() if k not in ("files", layout.MANIFEST_CHECKSUM)},
        "save_type": "merged",
        "merged_from": str(_checkpoint(src)),
    }
    content = {"model": tensors["model"], "optimizer": tensors["optimizer"], "ranks": ranks}
    if not isinstance(dst, Path):
        return _merge_to_object_store(dst, merged, content)
    tmp = dst.with_name(layout.temporary_name(dst.name))
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.suffix in MERGED_SUFFIXES:
            _save_durably(tmp, {**content, "manifest": merged})
            os.rename(tmp, dst)
            layout.fsync_dir(dst.parent)
            return dst
        tmp.mkdir()
        _save_durably(tmp / MERGED_FILE, content)
        layout.write_manifest(tmp, {**merged, "files": verification.hash_files(tmp, layout.list_files(tmp))})
        return layout.commit(tmp, dst)
    except BaseException as exc:  # nothing half written stays behind, whatever stopped it
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise CheckpointError(
                dst,
                f"could not be written ({type(exc).__name__}: {exc})",
                "check free space and permissions where it goes",
            ) from None
        raise


def _merge_to_object_store(dst: Any, merged: dict[str, Any], content: dict[str, Any]) -> Any:
    """merge_checkpoint's writing on an object store: a file is one PUT; a folder's manifest is
    written last (its commit); a failure removes what was written."""
    import io

    from kiln.checkpoint.hashing import HashingStream

    try:
        if dst.suffix in MERGED_SUFFIXES:
            buffer = io.BytesIO()
            torch.save({**content, "manifest": merged}, buffer)
            dst.write_bytes(buffer.getvalue())
            return dst
        with (dst / MERGED_FILE).open("wb") as f:
            stream = HashingStream(f)
            torch.save(content, stream)  # type: ignore[arg-type]  # a write-only stream is all torch.save needs
        layout.write_manifest(dst, {**merged, "files": {MERGED_FILE: stream.record()}})
        return dst
    except BaseException as exc:
        dst.rmtree()
        if isinstance(exc, OSError):
            raise CheckpointError(
                dst, f"could not be written ({type(exc).__name__}: {exc})", "check permissions where it goes"
            ) from None
        raise


def _save_durably(file: Path, obj: Any) -> None:
    with open(file, "wb") as f:  # straight to the file: no second copy in memory
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def safetensors_weights(state: Any, prefix: str, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The tensors of ``state`` whose names start with ``prefix`` (dropped from the names), cast
    to ``dtype`` when floating point, as safetensors' ``save_file`` takes them: contiguous, and a
    tensor sharing storage with an earlier one (tied weights), which it refuses, copied."""
    weights: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, value in sorted(state.items()):
        if not isinstance(value, torch.Tensor) or not name.startswith(prefix):
            continue
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        if value.untyped_storage().data_ptr() in seen:
            value = value.clone()
        seen.add(value.untyped_storage().data_ptr())
        weights[name[len(prefix) :]] = value.contiguous()
    return weights


def save_safetensors_file(weights: Mapping[str, torch.Tensor], file: Path, metadata: Mapping[str, str]) -> None:
    """safetensors' ``save_file`` into the new local ``file``, leaving it the mode ``open()`` gives a
    new file (0o666 less the umask, so 0o644 under the usual 022).

    safetensors creates its files 0o600, which left an export's weights unreadable to the group
    and others beside a 0o644 ``config.json``. The file is created here first, so the process's
    umask (and a default ACL) decides its mode as for any file kiln writes, and that mode is put
    back after safetensors has written it.
    """
    from safetensors.torch import save_file

    fd = os.open(file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
    save_file(dict(weights), str(file), metadata=dict(metadata))
    os.chmod(file, mode)


def export_safetensors(
    path: Any,
    out: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Any:
    """Write the model weights of a checkpoint to a ``.safetensors`` file (for inference and model hubs).

    Args:
        path: a checkpoint folder of any save type (a local path or a URL).
        out: the output file (or a folder, which gets ``model.safetensors``): a local path, written
            under a temporary name and renamed, or an fsspec URL, written by one PUT; either way
            the file appears whole or not at all.
        dtype: cast floating-point weights (``"bf16"``, ``"fp16"``, ``"fp32"``).
        storage_options: for URLs, the fsspec filesystem's options.

    Example::

        kiln.checkpoint.export_safetensors("runs/a/best", "model.safetensors", dtype="bf16")
    """
    from safetensors.torch import save

    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not known; expected one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    manifest, tensors, _ = load_full(as_path(path, storage_options), model_only=True)
    target = as_path(out, storage_options)
    if target.is_dir() or str(out).endswith("/"):
        target = target / "model.safetensors"
    weights = safetensors_weights(tensors["model"], "", dtype)
    metadata = {
        "format": "pt",
        "kiln_checkpoint": manifest["name"],
        "timestamp_batch": str((manifest.get("timestamp") or {}).get("batch", "")),
    }
    if not isinstance(target, Path):  # an object store: one PUT, so no reader sees half a file
        try:
            target.write_bytes(save(weights, metadata=metadata))
        except Exception as exc:
            raise CheckpointError(
                target,
                f"could not be written ({type(exc).__name__}: {exc})",
                "check the URL, the credentials and write access to the bucket",
            ) from None
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(layout.temporary_name(target.name))
    try:
        save_safetensors_file(weights, tmp, metadata)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target
