"""Reading checkpoint files without running code from them.

``torch.load(weights_only=True)`` refuses pickles that name arbitrary callables. DCP does not use
it everywhere: it reads ``.metadata`` with a bare ``pickle.load`` and non-tensor values with
``weights_only=False``, either of which runs whatever a crafted file asks for. This module closes
both doors: a metadata unpickler that accepts only DCP's own plain record classes, and a load
planner whose byte values go through ``weights_only=True``.

It also turns every way a damaged or crafted file can fail into one :class:`CheckpointError` that
names the file (and, inside a ``.distcp`` file, the entry): DCP's reader only says which rank failed.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from kiln.checkpoint import collectives
from kiln.checkpoint.errors import CheckpointError
from kiln.checkpoint.storage import FsspecStorage, as_path, storage_of

__all__ = [
    "safe_torch_load",
    "check_loadable",
    "read_dcp_metadata",
    "SafeFileSystemReader",
    "SafeFsspecReader",
    "SafeLoadPlanner",
    "SafeEmptyLoadPlanner",
    "dcp_failure",
    "check_dcp_bytes",
    "dcp_reader",
]

_UNSAFE_FIX = (
    "kiln loads checkpoints with weights_only=True and will not run code from a file; "
    "only load checkpoints from sources you trust, and save state as plain data"
)

# DCP metadata records: dataclasses and enums of plain values, nothing callable.
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix", "SerializationFormat"},
    "torch.serialization": {"_get_layout"},  # looks a layout up by name in a fixed table
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


def _opcode_table() -> tuple[list[int | None], int, int]:
    """For each byte, how :func:`check_memo_indices` skips that opcode's argument: n >= 0 bytes; -1
    to the next newline (-2: the next two); -3, -4, -6: a length in the next 1, 4 or 8 bytes,
    then that many; None for a byte that is no opcode. Then the codes of PUT and LONG_BINPUT."""
    import pickletools

    table: list[int | None] = [None] * 256
    counted = {
        pickletools.TAKEN_FROM_ARGUMENT1: -3,
        pickletools.TAKEN_FROM_ARGUMENT4: -4,
        pickletools.TAKEN_FROM_ARGUMENT4U: -4,
        pickletools.TAKEN_FROM_ARGUMENT8U: -6,
    }
    for op in pickletools.opcodes:
        code, arg = ord(op.code), op.arg
        if arg is None:
            table[code] = 0
        elif arg.n >= 0:
            table[code] = arg.n
        elif arg.n == pickletools.UP_TO_NEWLINE:
            table[code] = -2 if op.name in ("GLOBAL", "INST") else -1
        else:
            table[code] = counted[arg.n]
    return table, pickle.PUT[0], pickle.LONG_BINPUT[0]


_OPCODES, _PUT, _LONG_BINPUT = _opcode_table()


def check_memo_indices(data: bytes) -> None:
    """Raise ``ValueError`` when the pickle ``data`` stores into its memo at an index
    beyond its own length. The C unpickler grows its memo table to such an index at once, zeroed:
    one damaged byte (MEMOIZE turned LONG_BINPUT) made it take 21 GB. A pickle's memo never holds
    more entries than it has opcodes, so a sound one always passes. Runs over the opcodes without
    building anything (about 0.15 us each); a damaged opcode stream stops the walk, and the
    unpickler then reports it."""
    table, size, at = _OPCODES, len(data), 0
    find = data.find
    while at < size:
        code = data[at]
        n = table[code]
        at += 1
        if n is None:
            return
        if n > 0:
            if code == _LONG_BINPUT and int.from_bytes(data[at : at + 4], "little") > size:
                raise ValueError("a memo index beyond the pickle's length")
            at += n
        elif n == 0:
            continue
        elif n >= -2:
            end = find(b"\n", at)
            if end < 0:
                return
            if code == _PUT and data[at:end].isdigit() and int(data[at:end]) > size:
                raise ValueError("a memo index beyond the pickle's length")
            at = end + 1
            if n == -2:
                end = find(b"\n", at)
                if end < 0:
                    return
                at = end + 1
        else:
            width = 1 if n == -3 else 4 if n == -4 else 8
            at += width + int.from_bytes(data[at : at + width], "little")


_REFUSED = "global "  # how _MetadataUnpickler's refusal of a name starts: code, not damage


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{_REFUSED}{module}.{name} is not allowed in DCP metadata")


def read_dcp_metadata(path: Any) -> Metadata:
    """DCP's ``.metadata`` from checkpoint folder ``path``, refusing anything but its record classes."""
    file = as_path(path) / ".metadata"
    try:
        data = file.read_bytes()  # whole: the memo check walks it before the unpickler runs
        check_memo_indices(data)
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except FileNotFoundError:
        raise CheckpointError(
            file, "is missing (a sharded checkpoint needs it)", "copy the whole checkpoint folder"
        ) from None
    except Exception as exc:  # truncated or garbled pickles fail in many ways
        if isinstance(exc, pickle.UnpicklingError) and str(exc).startswith(_REFUSED):
            raise CheckpointError(file, f"asks to run code while loading ({exc})", _UNSAFE_FIX) from None
        raise CheckpointError(
            file,
            f"is damaged and cannot be read ({type(exc).__name__}: {exc})",
            "run `kiln checkpoint verify` on the folder; load an earlier checkpoint",
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(file, f"holds a {type(metadata).__name__}, not DCP metadata")
    _check_metadata(file, metadata)
    return metadata


def _check_metadata(file: Any, metadata: Metadata) -> None:
    """Raise unless the unpickled metadata is sound, so that damage fails here, naming the file,
    rather than deep inside DCP (or as a read of the wrong bytes, blamed on a ``.distcp`` file)."""

    def damaged(problem: str) -> CheckpointError:
        return CheckpointError(
            file, f"is damaged: {problem}", "run `kiln checkpoint verify` on the folder; load an earlier checkpoint"
        )

    entries, storage = getattr(metadata, "state_dict_metadata", None), getattr(metadata, "storage_data", None)
    if not (isinstance(entries, dict) and isinstance(storage, dict)):
        raise damaged("its tables are missing or not dictionaries")
    tables = entries, storage
    for key, md in tables[0].items():
        if not isinstance(key, str) or not _sound_entry(md):
            raise damaged(f"the record of {key!r} is malformed")
        for chunk in getattr(md, "chunks", [None]):  # every piece must have a place in the files
            if MetadataIndex(key, None if chunk is None else chunk.offsets) not in tables[1]:
                raise damaged(f"{key!r} has a piece that its storage table does not place in any file")
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in tables[1].items():
        fqn = getattr(index, "fqn", None)
        name, offset, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        if not isinstance(fqn, str) or fqn not in tables[0]:
            raise damaged(f"storage entry {fqn!r} is not in its state dict table")
        # A plain file name in the checkpoint folder: never a path that reads outside it.
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
            raise damaged(f"entry {fqn} points at {name!r}, not a file of the checkpoint")
        if not (type(offset) is int and type(length) is int and offset >= 0 and length >= 0):
            raise damaged(f"entry {fqn} has an invalid offset {offset!r} or length {length!r}")
        spans.setdefault(name, []).append((offset, offset + length, fqn))
    # DCP writes a file's entries one after another: two that overlap (other than one entry listed
    # twice) mean a damaged offset or length here; one that ends past the file, a truncated file.
    for name, entries in spans.items():
        entries.sort()
        for (start, end, fqn), (next_start, next_end, next_fqn) in zip(entries, entries[1:]):
            if next_start < end and (next_start, next_end) != (start, end):
                raise damaged(
                    f"entries {fqn} and {next_fqn} overlap in {name} (bytes {start}-{end} and {next_start}-{next_end})"
                )
        data = file.parent / name
        if not data.is_file():
            raise CheckpointError(
                file,
                f"places entry {entries[0][2]} in {name}, which is not in the checkpoint folder",
                "copy the whole checkpoint folder again; load an earlier checkpoint",
            )
        size = data.stat().st_size
        last_end, last_fqn = max((end, fqn) for _, end, fqn in entries)
        if last_end > size:
            raise CheckpointError(
                data,
                f"is truncated: {size} bytes, but .metadata places entry {last_fqn} up to byte {last_end}",
                "copy the whole checkpoint folder again; load an earlier checkpoint",
            )


def _sound_entry(md: Any) -> bool:
    """A BytesStorageMetadata, or a TensorStorageMetadata whose size, dtype and chunks are well formed."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    def shape(value: Any) -> bool:
        return isinstance(value, torch.Size) and all(type(n) is int and n >= 0 for n in value)

    if isinstance(md, BytesStorageMetadata):
        return True
    if not isinstance(md, TensorStorageMetadata):
        return False
    chunks, dtype = getattr(md, "chunks", None), getattr(getattr(md, "properties", None), "dtype", None)
    return (
        shape(getattr(md, "size", None))
        and isinstance(dtype, torch.dtype)
        and isinstance(chunks, list)
        and all(
            shape(getattr(c, "offsets", None))
            and shape(getattr(c, "sizes", None))
            and len(c.offsets) == len(c.sizes) == len(md.size)
            for c in chunks
        )
    )


class _SafeReading:
    """What makes DCP's readers safe: the safe metadata unpickler; a failure while reading an entry
    (damaged bytes, code in a pickle) is one CheckpointError naming the file and the entry."""

    path: Any
    load_id: Any
    storage_data: Any
    fs: Any
    transforms: Any
    _folder: Any = None  # the checkpoint folder as a kiln path (a RemotePath on fsspec storage)

    # The folder's metadata when the caller has already read (and checked) it: read once per load.
    known_metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self.known_metadata or read_dcp_metadata(self._where())
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata

    def _where(self) -> Any:
        return self._folder if self._folder is not None else as_path(self.path)

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        self._reading = sinfo  # which entry of which file is being read, for the error message
        return super()._slice_file(file, sinfo)  # type: ignore[misc]  # the DCP reader's, mixed in below

    # The checksums of (this rank's share of) the files, still being computed (a
    # kiln.checkpoint.verification.PendingChecksums), set by a verified load. They run while DCP
    # plans the load; nothing is read into the state until they matched on every rank.
    checksums: Any = None

    def read_data(self, plan: Any, planner: Any) -> Any:
        self._reading = None
        pending = self.checksums
        if pending is None:
            return self._read(plan, planner)
        error = None
        if not pending.keep:
            # The small pickled values (optimizer hyperparameters, step counts: most of the entries,
            # each a torch.load) go into the load's own dictionary, not the state, so they are read
            # while the checksums are still running. The tensors, which DCP copies straight into
            # the model and optimizer, wait.
            values = [item for item in plan.items if item.type == LoadItemType.BYTE_IO]
            plan = dataclasses.replace(plan, items=[item for item in plan.items if item.type != LoadItemType.BYTE_IO])
            try:
                self._read(dataclasses.replace(plan, items=values), planner)
            except CheckpointError as exc:
                error = exc
        # A checksum mismatch explains a damaged entry better than that entry's own failure.
        collectives.raise_together(pending.error() or error)
        if pending.kept:  # an object store: read the bytes the checksum pass downloaded
            self.fs = _KeptFiles(self.fs, pending.kept)
        return self._read(plan, planner)

    def _read(self, plan: Any, planner: Any) -> Any:
        try:
            self._read_items(plan, planner)
        except _EntryFailure as failure:  # from a reading thread, which names its entry itself
            raise self._failure(failure.error, failure.sinfo) from None
        except Exception as exc:
            raise self._failure(exc) from None
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_items(self, plan: Any, planner: Any) -> None:
        """DCP's ``FileSystemReader.read_data``, with two changes: a whole tensor is read from the
        file straight into its target's memory (DCP loads each entry into a new tensor and copies it
        over, which made that copy the largest part of a load: 0.11 s of 0.15 s for 1.2 GB), and
        with several files on local disk (or already downloaded) those reads run in one thread per
        file (``readinto`` releases the GIL: the copies from the page cache use every core)."""
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        files = list(per_file.items())
        with_tensors = sum(any(r.type != LoadItemType.BYTE_IO for r in reqs) for _, reqs in files)
        threads = min(with_tensors, _READ_THREADS)
        if threads > 1 and isinstance(self.fs, (FileSystem, _KeptFiles)):
            with ThreadPoolExecutor(threads, thread_name_prefix="kiln-read") as pool:
                rest = list(pool.map(lambda file: self._read_whole_tensors(planner, *file), files))
            files = [(relative_path, reqs) for (relative_path, _), reqs in zip(files, rest) if reqs]
        for relative_path, reqs in files:  # values, parts of tensors, other dtypes: as DCP does
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    info = self.storage_data[req.storage_index]
                    source = self.transforms.transform_load_stream(
                        req, info.transform_descriptors or (), self._slice_file(stream, info)
                    )
                    if req.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(req, io.BytesIO(source.read(-1)))
                        continue
                    if not source.seekable():
                        source = io.BytesIO(source.read(-1))
                    target = planner.resolve_tensor(req).detach()
                    if info.transform_descriptors or not _read_in_place(source, req, target):
                        tensor = torch.load(source, map_location="cpu", weights_only=True)
                        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                        if target.size() != tensor.size():
                            raise AssertionError(
                                f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}"
                            )
                        target.copy_(tensor)
                    planner.commit_tensor(req, target)

    def _read_whole_tensors(self, planner: Any, relative_path: str, reqs: list[Any]) -> list[Any]:
        """In a thread of its own: the whole tensors of ``relative_path`` that can be read in place
        are; the rest of ``reqs`` is returned, for the caller's thread (it changes the planner's
        dictionaries, which one thread at a time must do). A failure comes back naming its entry."""
        rest: list[Any] = []
        with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
            for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                info = self.storage_data[req.storage_index]
                if req.type == LoadItemType.BYTE_IO or info.transform_descriptors:
                    rest.append(req)
                    continue
                try:
                    # the DCP reader's slicing, not this class's: it notes the entry on self
                    source = FileSystemReader._slice_file(self, stream, info)  # type: ignore[arg-type]
                    target = planner.resolve_tensor(req).detach()
                    if not (source.seekable() and _read_in_place(source, req, target)):
                        rest.append(req)
                        continue
                except Exception as exc:
                    raise _EntryFailure(info, exc) from None
                planner.commit_tensor(req, target)
        return rest

    def _failure(self, exc: Exception, sinfo: Any = None) -> CheckpointError:
        """The CheckpointError for ``exc``, raised while reading entry ``sinfo`` (by default the one
        this thread's ``_slice_file`` noted last)."""
        sinfo = sinfo or getattr(self, "_reading", None)
        if sinfo is None and isinstance(exc, OSError) and exc.filename:  # opening a file failed
            return CheckpointError(
                exc.filename,
                f"could not be read ({type(exc).__name__}: {exc.strerror or exc})",
                "copy the whole checkpoint folder again; load an earlier checkpoint",
            )
        if sinfo is None:  # the plan DCP made from .metadata does not fit its own tables
            return CheckpointError(
                self._where() / ".metadata",
                f"is damaged: its entries do not fit its storage table ({type(exc).__name__}: {_first_line(exc)})",
                "run `kiln checkpoint verify` on the folder; load an earlier checkpoint",
            )
        file = self._where() / sinfo.relative_path
        key = next((index.fqn for index, info in self.storage_data.items() if info is sinfo), "?")
        # The bytes are where .metadata says; with both files damaged alike, either may be at fault.
        entry = f"entry {key} (bytes {sinfo.offset}-{sinfo.offset + sinfo.length}, as .metadata places it)"
        if isinstance(exc, CheckpointError) and exc.path == _VALUE:
            return CheckpointError(file, f"{entry} {exc.problem}", exc.fix)
        return CheckpointError(
            file,
            f"is damaged: {entry} could not be read ({type(exc).__name__}: {_first_line(exc)})",
            "run `kiln checkpoint verify` on the folder; load an earlier checkpoint",
        )


def _read_in_place(entry: Any, req: Any, target: torch.Tensor) -> bool:
    """Read the tensor saved in ``entry`` (a seekable stream of one ``torch.save`` archive) straight
    into ``target``, when it is the whole tensor, of the same dtype and contiguous on both
    sides, and ``target`` is in CPU memory; False (nothing read) otherwise.

    Where the data starts comes from the archive's zip directory, and the tensor's dtype, shape,
    strides and storage offset from its pickle, read by :class:`_TensorRecordUnpickler` (which
    builds nothing): a ``torch.load`` onto the meta device tells the same for 15x the time, which
    was a fifth of a verified load with hundreds of tensors.
    """
    if target.device.type != "cpu" or not target.is_contiguous() or sys.byteorder != "little":
        return False
    record = _tensor_record(entry)
    entry.seek(0)
    if record is None:
        return False
    dtype, size, stride, storage_offset, data_offset, data_bytes = record
    shape = tuple(target.shape)
    if (
        dtype != target.dtype
        or size != shape
        or stride != _contiguous_strides(shape)
        or any(req.storage_offsets)
        or tuple(req.lengths) != shape
    ):
        return False
    nbytes = target.numel() * target.element_size()
    if nbytes == 0:
        return True
    start = storage_offset * target.element_size()
    if start + nbytes > data_bytes:
        raise EOFError(f"the entry's data holds {data_bytes} bytes, short of its tensor's {start + nbytes}")
    entry.seek(data_offset + start)
    data: Any = target.view(-1).view(torch.uint8).numpy()  # the target's own memory, as bytes
    view = memoryview(data)
    filled = 0
    while filled < nbytes:
        got = entry.readinto(view[filled:])
        if not got:
            raise EOFError(f"the entry ends {nbytes - filled} bytes short of its tensor")
        filled += got
    return True


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _archive_pickle(stream: Any) -> tuple[Any, bytes]:
    """The zip reader of the ``torch.save`` archive in ``stream`` and its pickle (``data.pkl``),
    whose memo indices :func:`check_memo_indices` has checked (ValueError), ready for an unpickler.
    Any: torch's stubs lack ``has_record`` and ``get_record_offset``, which torch.serialization calls."""
    reader: Any = torch._C.PyTorchFileReader(stream)
    pickled = reader.get_record("data.pkl")
    check_memo_indices(pickled)
    return reader, pickled


def _tensor_record(entry: Any) -> tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int, int, int] | None:
    """``(dtype, size, stride, storage_offset, data offset, data bytes)`` of the one tensor that the
    ``torch.save`` archive in ``entry`` holds (offsets from the archive's start); None when it holds
    anything else (then the caller loads it with ``torch.load``, weights-only)."""
    try:
        reader, pickled = _archive_pickle(entry)  # a damaged zip directory raises (RuntimeError)
        found = _TensorRecordUnpickler(io.BytesIO(pickled)).load()
    except (pickle.UnpicklingError, TypeError, ValueError, EOFError, IndexError, KeyError):
        return None
    if reader.get_record("byteorder") not in (b"little", None):
        return None
    if not (isinstance(found, tuple) and len(found) == 5 and found[0] is _TensorRecordUnpickler):
        return None
    _, (dtype, key, numel), storage_offset, size, stride = found
    name = f"data/{key}"
    if not reader.has_record(name):
        return None
    data_bytes = reader.get_record_size(name)
    if numel * dtype.itemsize > data_bytes:
        return None
    return dtype, size, stride, storage_offset, reader.get_record_offset(name), data_bytes


def _ints(value: Any) -> bool:
    return isinstance(value, tuple) and all(type(n) is int and n >= 0 for n in value)


class _TensorRecordUnpickler(pickle.Unpickler):
    """Reads the pickle of a ``torch.save``d tensor into ``(_TensorRecordUnpickler, (dtype, storage
    key, numel), storage_offset, size, stride)``, calling nothing: the three names such a pickle
    uses map to record-building functions of this class, any other name fails the read."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return self._tensor
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        storage = getattr(torch, name, None) if module == "torch" and name.endswith("Storage") else None
        if isinstance(storage, type) and issubclass(storage, torch.storage._LegacyStorage):
            return storage._dtype  # the class's dtype (.dtype says the same with a deprecation warning)
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError("not a storage")
        _, dtype, key, _location, numel = pid
        if not (isinstance(dtype, torch.dtype) and isinstance(key, str) and type(numel) is int and numel >= 0):
            raise pickle.UnpicklingError("a malformed storage")
        return dtype, key, numel

    @staticmethod
    def _tensor(storage: Any, storage_offset: Any, size: Any, stride: Any, *rest: Any) -> Any:
        if not (type(storage_offset) is int and storage_offset >= 0 and _ints(size) and _ints(stride)):
            raise pickle.UnpicklingError("a malformed tensor")
        if len(size) != len(stride) or not isinstance(storage, tuple):
            raise pickle.UnpicklingError("a malformed tensor")
        return _TensorRecordUnpickler, storage, storage_offset, size, stride


# Threads reading a checkpoint's files at once: one per core, as far as there are files (DCP writes
# two per rank here, one per writer thread).
_READ_THREADS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


class _EntryFailure(Exception):
    """A failure while a reading thread read entry ``sinfo``."""

    def __init__(self, sinfo: Any, error: Exception) -> None:
        super().__init__(str(error))
        self.sinfo, self.error = sinfo, error


class _KeptFiles:
    """DCP's filesystem object, reading the files in ``kept`` (name to bytes) from memory."""

    def __init__(self, inner: Any, kept: dict[str, bytes]) -> None:
        self.inner, self.kept = inner, kept

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        data = self.kept.get(os.path.basename(str(path).rstrip("/")))
        if data is None or "r" not in mode:
            with self.inner.create_stream(path, mode) as stream:
                yield stream
        else:
            yield io.BytesIO(data)  # shares the bytes, no copy

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class SafeFileSystemReader(_SafeReading, FileSystemReader):
    """DCP's file reader, made safe (see :class:`_SafeReading`)."""


class SafeFsspecReader(_SafeReading, FileSystemReader):
    """DCP's fsspec reader, made safe, on a :class:`kiln.checkpoint.storage.RemotePath`'s filesystem
    (and so with its storage options)."""

    def __init__(self, folder: Any) -> None:
        from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem

        super().__init__(str(folder))
        fs = FsspecFileSystem()
        fs.fs = folder.fs
        self.fs = fs  # what FsspecReader itself sets
        self.path = str(folder)
        self._folder = folder


_VALUE = "<sharded checkpoint value>"  # replaced by the file and entry once the reader knows them


def _load_bytes(value: io.BytesIO) -> Any:
    plain = _plain_value(value)
    if plain is not _NOT_PLAIN:
        return plain
    value.seek(0)
    try:
        return torch.load(value, weights_only=True)
    except Exception as exc:  # a damaged value fails in many ways; all are one CheckpointError
        raise _load_failure(_VALUE, exc) from None


_NOT_PLAIN = object()


def _plain_value(value: io.BytesIO) -> Any:
    """The value in the ``torch.save`` archive ``value`` when its pickle holds only Python's own
    types (numbers, strings, bytes, None, tuples, lists, dicts, sets: an optimizer's
    hyperparameters, which DCP stores one entry per parameter and name), else ``_NOT_PLAIN``.

    Such a pickle names no global and no storage, so an unpickler that refuses both reads it
    exactly as ``torch.load(weights_only=True)`` does, for a tenth of the time (0.05 s of a 1.2 GB
    load went to 528 of them). Anything else is left to ``torch.load``."""
    try:
        _, pickled = _archive_pickle(value)
        return _PlainUnpickler(io.BytesIO(pickled)).load()
    except Exception:  # not an archive, a global, a tensor, damage: torch.load decides, and names it
        return _NOT_PLAIN


class _PlainUnpickler(pickle.Unpickler):
    """Python's own types only: any global or persistent id (a storage) fails the read."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a storage")


def _load_failure(path: str | os.PathLike, exc: BaseException) -> CheckpointError:
    """The CheckpointError for ``torch.load(path, weights_only=True)`` raising ``exc``.

    torch's safe unpickler refuses what it does not know: a callable or class (code, in a crafted
    file) or an opcode it does not handle (damage, or a bare pickle, the form crafted files take).
    Only the first is certainly code; the second is reported as either.
    """
    detail = _first_line(exc)
    if isinstance(exc, pickle.UnpicklingError) and "weights only load failed" in str(exc).lower():
        if any(word in detail for word in ("GLOBAL", "reduce", "Can only", "new object")):
            return CheckpointError(path, f"asks to run code while loading ({detail})", _UNSAFE_FIX)
        return CheckpointError(
            path, f"cannot be unpickled safely ({detail}): it is damaged, or crafted to run code", _UNSAFE_FIX
        )
    return CheckpointError(
        path,
        f"is truncated or damaged ({type(exc).__name__}: {detail})",
        "run `kiln checkpoint verify` on the folder; load an earlier checkpoint",
    )


def dcp_failure(exc: BaseException, path: Any) -> CheckpointError:
    """One CheckpointError for whatever a DCP load of the checkpoint folder ``path`` raised.

    DCP wraps each rank's exception, with its traceback, in a CheckpointException (a BaseException);
    the first one is reported. Failures the reader names are passed on; others happened while DCP
    planned the load from ``.metadata``, so they name that file.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException):
        failures = list((getattr(exc, "failures", None) or {}).values())
        first = failures[0] if failures else exc
        exc = first[0] if isinstance(first, tuple) and first and isinstance(first[0], BaseException) else first
    if isinstance(exc, CheckpointError):
        return exc
    return CheckpointError(
        as_path(path) / ".metadata",
        f"could not be used to load the checkpoint ({type(exc).__name__}: {_first_line(exc)})",
        "run `kiln checkpoint verify` on the folder; load an earlier checkpoint",
    )


def check_dcp_bytes(path: Any, metadata: Metadata) -> None:
    """Load every non-tensor entry of a DCP checkpoint (small pickled values) the safe way, so that
    ``verify`` refuses a checkpoint that carries code in any pickle, not only in the ones a load reads first."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    keys = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    if not keys:
        return
    try:
        _load_state_dict({}, storage_reader=dcp_reader(path), planner=SafeEmptyLoadPlanner(keys=keys), no_dist=True)
    except (Exception, CheckpointException) as exc:  # DCP wraps failures in a BaseException
        raise dcp_failure(exc, path) from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        # DefaultLoadPlanner.load_bytes with the one change that matters: weights_only=True.
        obj = _load_bytes(value)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class SafeEmptyLoadPlanner(_EmptyStateDictLoadPlanner):
    """Load a whole DCP checkpoint into a fresh dict (no model needed), values with ``weights_only=True``."""

    load_bytes = SafeLoadPlanner.load_bytes


def _first_line(exc: BaseException) -> str:
    """The line of an exception's message that says what happened (torch's weights_only errors
    wrap it in advice about weights_only=False, which kiln will not take)."""
    text = str(exc).strip()
    text = text.split("WeightsUnpickler error:", 1)[-1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = next((line for line in lines if "GLOBAL" in line), lines[0] if lines else "")
    return line if len(line) <= 300 else line[:297] + "..."


def dcp_reader(folder: Any) -> Any:
    """DCP's safe reader for the checkpoint folder ``folder`` (a local path or a URL)."""
    # The reader goes with the storage (the storage layer below knows no reader): a local folder's
    # files are read in place, an object store's through fsspec.
    folder = as_path(folder)
    reader = SafeFsspecReader if isinstance(storage_of(folder), FsspecStorage) else SafeFileSystemReader
    return reader(folder)


def safe_torch_load(path: Any, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``; every failure is one CheckpointError naming the file."""
    path = as_path(path)
    try:
        source = storage_of(path).read_for_load(path)
        return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap and isinstance(source, Path))
    except FileNotFoundError:
        raise CheckpointError(path, "is missing", "copy the whole checkpoint folder") from None
    except Exception as exc:  # a damaged zip or pickle fails in many ways (RuntimeError, EOFError, KeyError, ...)
        raise _load_failure(path, exc) from None


def check_loadable(obj: Any, what: str) -> bytes:
    """``torch.save`` bytes of ``obj``, after checking they load back with ``weights_only=True``.

    Run at save time, so that a callback returning a custom object from ``state_dict()`` fails when
    saving, naming the callback, rather than months later when someone tries to resume.
    """
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            what,
            f"holds an object a checkpoint cannot carry ({_first_line(exc)})",
            "return plain data (numbers, strings, lists, dicts, tensors) from state_dict(), "
            "since checkpoints load with weights_only=True",
        ) from None
    return data
