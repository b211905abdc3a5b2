"""Writing a Hugging Face model folder one tensor at a time: sharded safetensors files,
``model.safetensors.index.json`` and ``config.json``, under a temporary name renamed when whole.

A safetensors file is an 8-byte header length, a JSON header (each tensor's dtype, shape and byte
range) and the tensors' bytes. Shapes and dtypes are known before any value (a DCP checkpoint's
metadata, a sharded model's DTensors), so the header is written first and each tensor is fetched
(:attr:`TensorSource.load`: a read of one key from a checkpoint, or one all-gather), written and
dropped: the writer holds one tensor at a time, never the model.

It lives in ``kiln.models`` (with the reader, :mod:`kiln.models.hf_weights`) because both the
offline export (:mod:`kiln.checkpoint.hf_export`) and the training callback
(:mod:`kiln.callbacks.hf_export`) write folders, and the callbacks sit below the checkpoint layer.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["TensorSource", "parse_size", "plan_files", "write_hf_folder", "DEFAULT_MAX_SHARD_SIZE"]

DEFAULT_MAX_SHARD_SIZE = "5GB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def parse_size(size: int | str) -> int:
    """Bytes of ``"5GB"``, ``"20KB"``, ``"500MiB"`` or an int (transformers' ``max_shard_size``)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(size))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"max_shard_size={size!r} is not a size; expected e.g. '5GB', '500MB', '20KB' or a number of bytes"
        )
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class TensorSource:
    """One tensor of the folder: its name there, shape and dtype, and how to fetch its value
    (called once, when the writer reaches it; the value may be in another dtype, it is cast)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    load: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * torch.empty((), dtype=self.dtype).element_size()


def plan_files(sources: list[TensorSource], max_bytes: int) -> list[list[TensorSource]]:
    """The tensors in order, cut into files of at most ``max_bytes`` (a larger tensor gets a file
    of its own), as transformers' ``save_pretrained(max_shard_size=...)`` cuts them."""
    files: list[list[TensorSource]] = [[]]
    size = 0
    for source in sources:
        if files[-1] and size + source.nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(source)
        size += source.nbytes
    return files if files[0] else []


def _file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _write_file(file: Path, sources: list[TensorSource]) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}  # transformers refuses a file without it
    offset = 0
    for source in sources:
        if source.dtype not in _NAMES:
            raise ValueError(f"{source.name}: dtype {source.dtype} cannot be written to safetensors by kiln")
        header[source.name] = {
            "dtype": _NAMES[source.dtype],
            "shape": list(source.shape),
            "data_offsets": [offset, offset + source.nbytes],
        }
        offset += source.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    fd = os.open(file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)  # the umask decides the mode
    with os.fdopen(fd, "wb") as out:
        out.write(len(encoded).to_bytes(8, "little"))
        out.write(encoded)
        for source in sources:
            value = source.load()
            value = value.detach().to(device="cpu", dtype=source.dtype).contiguous()
            if tuple(value.shape) != source.shape:
                raise ValueError(f"{source.name}: fetched shape {tuple(value.shape)}, expected {source.shape}")
            out.write(value.reshape(-1).view(torch.uint8).numpy().data)
            del value
        out.flush()
        os.fsync(out.fileno())


def write_hf_folder(
    out: str | os.PathLike,
    config: Mapping[str, Any],
    sources: Iterable[TensorSource],
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    tokenizer: Any = None,
    temporary_name: Callable[[str], str] | None = None,
) -> Path:
    """Write the folder ``out`` (which must not exist): the tensors in files of at most
    ``max_shard_size``, an index when there are several, ``config.json`` (with ``dtype`` set to the
    first floating tensor's, what ``from_pretrained(dtype="auto")`` builds). Written under a
    temporary name beside ``out`` and renamed: a reader sees the whole folder or none.

    Example::

        write_hf_folder("out", config, [TensorSource("w", (2, 2), torch.float32, lambda: torch.ones(2, 2))])
    """
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise FileExistsError(f"{out} already exists; choose a new folder for the export, or remove it first")
    sources = list(sources)
    files = plan_files(sources, parse_size(max_shard_size))
    names = _file_names(len(files))
    config = dict(config)
    floating = [s.dtype for s in sources if s.dtype.is_floating_point]
    if floating:
        config["dtype"] = str(floating[0]).replace("torch.", "")
    tmp = out.with_name(temporary_name(out.name) if temporary_name else f".{out.name}.tmp-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        for name, group in zip(names, files):
            _write_file(tmp / name, group)
        if len(files) > 1:
            index = {
                "metadata": {"total_size": sum(s.nbytes for s in sources)},
                "weight_map": {s.name: name for name, group in zip(names, files) for s in group},
            }
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _fsync_dir(tmp)
        os.rename(tmp, out)
        _fsync_dir(out.parent)
    except BaseException:  # nothing half written stays behind, whatever stopped it
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
