"""Hugging Face safetensors weights read straight into a model that may already be sharded.

:meth:`kiln.models.HuggingFaceModel.from_pretrained` builds the transformers model on the meta
device (no storage, no initialisation) and records where its weights are
(:class:`PretrainedWeights`). The strategy then shards the meta model (tensor parallelism turns
weights into DTensors, FSDP2 shards them again); only then does the model get storage, and
:func:`load_pretrained_weights` fills each rank's own part: for every parameter and persistent
buffer it asks the tensor which part of the whole it holds (a DTensor's local shape and global
offset, from its mesh and placements; a plain tensor holds all of it) and reads just that box from
the safetensors files (:class:`SafetensorsFile`: byte ranges, not a mapping of the file). No rank ever holds a whole copy of a
sharded weight: the peak above the model's own shards is one read slice.

What transformers' ``from_pretrained`` does besides, done the same way here so the weights are
equal to the bit:

* the folder holds ``model.safetensors`` or several files and ``model.safetensors.index.json``;
* keys are renamed and fused by transformers' own conversion mapping (Mixtral's checkpoints keep
  one ``w1``/``w2``/``w3`` per expert, its model one fused ``gate_up_proj``/``down_proj``); a
  fused weight is read as the pieces it is made of, each piece's box intersected with the shard;
* each value is cast to the parameter's dtype (``Tensor.copy_``, the cast ``.to`` makes);
* a tied weight absent from the files (``lm_head.weight``) reads its source's key;
* everything not in the files (non-persistent buffers such as rotary ``inv_freq``, missing keys)
  is initialised by the model's own ``initialize_weights``, which skips what was loaded (the
  ``_is_hf_initialized`` mark transformers itself sets).

Under a pipeline no rank holds the whole model either: :func:`load_pretrained_buffers` gives the
buffers their values before the trace (the parameters stay on the meta device; the pipeline traces
them as fake tensors, :mod:`kiln.parallel.pipelining.runtime`), and after the cut and the stage's
own tensor-parallel and FSDP steps :func:`load_stage_weights` reads each rank's part of its
stage(s), by the names the stage keeps (the original ones).

Why here, in ``kiln.models``: the reading needs torch, safetensors and the transformers model,
nothing of kiln above this layer, so the strategy layer (which decides *when*: after its sharding
steps, :func:`kiln.parallel.transforms.parallelize.materialize`) calls down into it through the
model's ``load_deferred_weights`` method, and no import runs up (tests/test_layers.py).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

__all__ = [
    "INDEX_FILE",
    "WEIGHTS_FILE",
    "PretrainedWeights",
    "SafetensorsFile",
    "checkpoint_keys",
    "is_local_checkpoint",
    "load_pretrained_buffers",
    "load_pretrained_weights",
    "load_stage_weights",
    "materialize_meta",
    "meta_model",
    "missing_parameters",
    "resolve_dtype",
]

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class PretrainedWeights:
    """Where a model built on the meta device takes its weights from: a local folder of
    safetensors files (``model.safetensors``, or several with ``model.safetensors.index.json``)."""

    folder: Path


def is_local_checkpoint(name_or_path: str | os.PathLike) -> bool:
    """Whether ``name_or_path`` is a local folder with safetensors weights (single or indexed)."""
    folder = Path(name_or_path)
    return (folder / INDEX_FILE).is_file() or (folder / WEIGHTS_FILE).is_file()


def checkpoint_keys(folder: str | os.PathLike) -> dict[str, Path]:
    """Every tensor name in the folder's safetensors files -> the file that holds it."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {key: folder / name for key, name in weight_map.items()}
    single = folder / WEIGHTS_FILE
    if not single.is_file():
        raise FileNotFoundError(f"{folder} holds neither {WEIGHTS_FILE} nor {INDEX_FILE}")
    file = SafetensorsFile(single)
    file.close()
    return dict.fromkeys(file.keys(), single)


def resolve_dtype(config: Any, dtype: torch.dtype | str | None, folder: Path) -> torch.dtype:
    """The dtype transformers' ``from_pretrained`` builds the model in: the one asked for, else
    (``"auto"``, its default) the config's ``dtype``, else the first floating tensor's of the first file."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in (None, "auto"):
        return getattr(torch, str(dtype).replace("torch.", ""))
    saved = getattr(config, "dtype", None)
    if isinstance(saved, torch.dtype):
        return saved
    if isinstance(saved, str):
        return getattr(torch, saved.replace("torch.", ""))
    keys = checkpoint_keys(folder)
    if keys:
        file = SafetensorsFile(sorted(set(keys.values()))[0])
        try:
            for entry in file.entries.values():
                value = _SAFETENSORS_DTYPES.get(entry["dtype"])
                if value is not None and value.is_floating_point:
                    return value
        finally:
            file.close()
    return torch.get_default_dtype()


# safetensors header dtype codes -> torch dtypes (a file format's names, not kiln's precision names)
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


# -- reading boxes of tensors from a safetensors file ----------------------------------------------
class SafetensorsFile:
    """A safetensors file read by byte ranges: :meth:`read` returns a box of one tensor, read with
    ``pread`` as the few contiguous runs that make it up, so the process holds that box and no more.

    safetensors' own ``safe_open(...).get_slice`` maps the file and faults in the whole tensor
    behind a slice (each rank's resident memory grew by the whole model's files, measured); plain
    reads leave the pages in the page cache, shared and outside the process's resident memory.
    The format: 8 bytes little-endian header length, a JSON header (each tensor's ``dtype``,
    ``shape`` and ``data_offsets`` in the data after the header), then the data.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as file:
            length = int.from_bytes(file.read(8), "little")
            header = json.loads(file.read(length))
        self.metadata = header.pop("__metadata__", None) or {}
        self.entries: dict[str, dict[str, Any]] = header
        self._data_start = 8 + length
        self._fd = os.open(self.path, os.O_RDONLY)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.entries[key]["shape"])

    def dtype(self, key: str) -> torch.dtype:
        name = self.entries[key]["dtype"]
        if name not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{self.path}: {key} has dtype {name}, which kiln does not read")
        return _SAFETENSORS_DTYPES[name]

    def read(self, key: str, box: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The box ``box`` (one slice per dim, steps of 1; None: all) of tensor ``key``."""
        shape = self.shape(key)
        dtype = self.dtype(key)
        box = box if box is not None else tuple(slice(0, n) for n in shape)
        lo = [b.start for b in box]
        hi = [b.stop for b in box]
        out = torch.empty([h - l for l, h in zip(lo, hi)], dtype=dtype)
        if out.numel() == 0:
            return out
        item = out.element_size()
        # the dims after `split` are read whole: each run is the box's range on `split` times them
        split = len(shape) - 1
        while split > 0 and lo[split] == 0 and hi[split] == shape[split]:
            split -= 1
        strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        start = self._data_start + self.entries[key]["data_offsets"][0]
        run = (hi[split] - lo[split]) * (strides[split] if shape else 1) * item
        buffer = out.view(torch.uint8).reshape(-1).numpy()
        written = 0
        for index in _outer_indices(lo[:split], hi[:split]):
            element = sum(i * strides[d] for d, i in enumerate(index)) + (lo[split] * strides[split] if shape else 0)
            view = buffer.data[written : written + run]
            got = os.preadv(self._fd, [view], start + element * item)
            if got != run:
                raise OSError(f"{self.path}: {key} is cut short (read {got} of {run} bytes)")
            written += run
        return out


def _outer_indices(lo: list[int], hi: list[int]) -> Iterator[tuple[int, ...]]:
    import itertools

    return itertools.product(*(range(a, b) for a, b in zip(lo, hi)))


# -- where a model tensor's values are in the files -------------------------------------------------
@dataclass(frozen=True)
class _Piece:
    """One file tensor inside a model tensor: its box there starts at ``offset`` and has ``shape``
    (a stacked piece has extent 1 on the stacked dim 0, which the file tensor lacks)."""

    key: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    stacked: bool


def _layout(
    hf_model: nn.Module, keys: Mapping[str, Path], files: Mapping[str, SafetensorsFile]
) -> dict[str, list[_Piece]]:
    """Model tensor name (of the transformers model) -> the file pieces it is made of."""
    renamings, converters = _conversions(hf_model)
    names = dict(hf_model.state_dict(keep_vars=True))
    prefix = getattr(hf_model, "base_model_prefix", None)
    shapes = {key: files[key].shape(key) for key in keys}
    grouped: dict[str, list[tuple[str, str | None]]] = {}
    for key in keys:
        target, pattern = _rename(key, renamings, converters, prefix, names)
        grouped.setdefault(target, []).append((key, pattern))
    layout: dict[str, list[_Piece]] = {}
    for target, sources in grouped.items():
        if len(sources) == 1 and sources[0][1] is None:
            key = sources[0][0]
            layout[target] = [_Piece(key, (0,) * len(shapes[key]), shapes[key], stacked=False)]
            continue
        converter = next(c for c in converters if sources[0][1] in c.source_patterns)
        layout[target] = _fused_pieces(target, sources, converter, shapes)
    return layout


def _conversions(hf_model: nn.Module) -> tuple[list[Any], list[Any]]:
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # pragma: no cover - an older transformers: keys are the model's names
        return [], []
    mapping = get_model_conversion_mapping(cast(Any, hf_model))  # a PreTrainedModel
    return (
        [t for t in mapping if isinstance(t, WeightRenaming)],
        [t for t in mapping if isinstance(t, WeightConverter)],
    )


def _rename(
    key: str, renamings: list[Any], converters: list[Any], prefix: Any, names: dict[str, Any]
) -> tuple[str, str | None]:
    if not renamings and not converters:
        return key, None
    from transformers.core_model_loading import rename_source_key

    return rename_source_key(key, renamings, converters, prefix, names)


def _fused_pieces(
    target: str, sources: list[tuple[str, str | None]], converter: Any, shapes: Mapping[str, tuple[int, ...]]
) -> list[_Piece]:
    """The pieces of a weight transformers fuses on load: ``MergeModulelist(dim=0)`` stacks each
    source pattern's numbered tensors, then ``Concatenate(dim=d)`` joins the patterns' stacks."""
    ops = [(type(op).__name__, getattr(op, "dim", 0)) for op in converter.operations]
    stacked = bool(ops) and ops[0] == ("MergeModulelist", 0)
    rest = ops[1:] if stacked else ops
    concat_dim = None
    if len(rest) == 1 and rest[0][0] == "Concatenate":
        concat_dim = rest[0][1]
    elif rest:
        raise NotImplementedError(
            f"{target}: kiln reads fused Hugging Face weights made by MergeModulelist(dim=0) and Concatenate; "
            f"this model's conversion is {[name for name, _ in ops]}: load it with transformers' from_pretrained "
            "(HuggingFaceModel(AutoModel.from_pretrained(...)))"
        )
    patterns = list(converter.source_patterns)
    pieces: list[_Piece] = []
    along = 0  # where the next pattern starts on the concatenated dim
    for pattern in patterns:
        regex = re.compile(re.escape(pattern).replace(r"\*", r"(\d+)"))
        found = []
        for key, matched in sources:
            if matched != pattern:
                continue
            hit = regex.search(key)
            index = int(hit.group(1)) if hit and hit.groups() else 0
            found.append((index, key))
        found.sort()
        width = 0
        for position, (_, key) in enumerate(found):
            source = shapes[key]
            shape = (1, *source) if stacked else source
            offset = [0] * len(shape)
            if stacked:
                offset[0] = position
            if concat_dim is not None:
                offset[concat_dim] = along
                width = shape[concat_dim]
            pieces.append(_Piece(key, tuple(offset), tuple(shape), stacked))
        along += width
    return pieces


# -- reading the pieces into each rank's shards -----------------------------------------------------
def _local_boxes(tensor: torch.Tensor) -> list[tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
    """Each (part of the local tensor this rank writes, its shape, its offset in the whole tensor):
    one box, or ``split_factor`` boxes along a ``_StridedShard`` dimension (fused experts' gate and
    up rows: kiln.parallel.transforms.fused_experts), whose local tensor is those boxes end to end."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(tensor, DTensor):
        return [(tensor, tuple(tensor.shape), (0,) * tensor.dim())]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh, placements = tensor.device_mesh, tensor.placements
    # a _StridedShard alone on its dimension (fused experts' packed rows); FSDP's _StridedShard over
    # a dimension tensor parallelism shards too is one contiguous box, which torch computes
    strided = [
        (i, p)
        for i, p in enumerate(placements)
        if isinstance(p, _StridedShard) and sum(getattr(q, "dim", None) == p.dim for q in placements) == 1
    ]
    plain = [Replicate() if any(p is q for _, q in strided) else p for p in placements]
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, plain)
    boxes = [(tensor.to_local(), tuple(shape), tuple(offset))]
    for mesh_dim, placement in strided:
        dim, factor, ranks = placement.dim, placement.split_factor, mesh.size(mesh_dim)
        rank = mesh.get_local_rank(mesh_dim)
        split = []
        for local, box_shape, box_offset in boxes:
            whole = box_shape[dim]
            piece = whole // (factor * ranks)  # fused_experts refuses sizes that do not divide
            for j in range(factor):
                where = box_offset[dim] + j * (whole // factor) + rank * piece
                split.append(
                    (
                        local.narrow(dim, j * piece, piece),
                        box_shape[:dim] + (piece,) + box_shape[dim + 1 :],
                        box_offset[:dim] + (where,) + box_offset[dim + 1 :],
                    )
                )
        boxes = split
    return boxes


def _read_into(
    local: torch.Tensor, shape: tuple[int, ...], offset: tuple[int, ...], pieces: list[_Piece], files: Mapping[str, Any]
) -> None:
    """Copy the part of ``pieces`` inside the box (``offset``, ``shape``) into ``local``."""
    if local.numel() == 0:
        return
    for piece in pieces:
        lo = [max(o, p) for o, p in zip(offset, piece.offset)]
        hi = [min(o + s, p + n) for o, s, p, n in zip(offset, shape, piece.offset, piece.shape)]
        if any(a >= b for a, b in zip(lo, hi)):
            continue
        source = [slice(a - p, b - p) for a, b, p in zip(lo, hi, piece.offset)]
        if piece.stacked:
            source = source[1:]
        value = files[piece.key].read(piece.key, tuple(source))
        if piece.stacked:
            value = value.unsqueeze(0)
        destination = local[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset))]
        destination.copy_(value.reshape(destination.shape))  # copy_ casts as .to() does


def _tensors(hf_model: nn.Module) -> Iterator[tuple[list[str], torch.Tensor]]:
    """Each distinct parameter and persistent buffer with all the names it has (tied weights have two)."""
    seen: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, value in hf_model.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor):
            seen.setdefault(id(value), ([], value))[0].append(name)
    yield from seen.values()


def materialize_meta(module: nn.Module, device: torch.device | str) -> None:
    """Give every meta tensor of ``module`` (parameters, DTensor shards, buffers) empty storage on
    ``device``; others stay as they are. A sharded parameter gets storage for its shard only. A
    tensor that several modules hold (tied embeddings: ``lm_head.weight is embed_tokens.weight``)
    stays one tensor, held by all of them, as after transformers' ``from_pretrained``."""
    holders: dict[int, list[tuple[dict[str, Any], str]]] = {}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, value in table.items():
                if value is not None and value.is_meta:
                    holders.setdefault(id(value), []).append((table, name))
    # Module._apply cannot move a meta tensor's data in place (meta and CPU storage are not
    # interchangeable), so it makes a new Parameter for each module it visits: a tied weight
    # came out as two, loaded equal but trained apart. Every holder gets the first holder's
    # (in module order: the one FSDP2, whose _apply re-reads its parameters, keeps).
    module._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    for places in holders.values():
        first_table, first_name = places[0]
        for table, name in places[1:]:
            table[name] = first_table[first_name]


class _Checkpoint:
    """The folder's files opened once, and where each of ``hf_model``'s tensors is in them."""

    def __init__(self, hf_model: nn.Module, folder: str | os.PathLike) -> None:
        keys = checkpoint_keys(folder)
        self.handles = {file: SafetensorsFile(file) for file in sorted(set(keys.values()))}
        self.files = {key: self.handles[file] for key, file in keys.items()}
        self.layout = _layout(hf_model, keys, self.files)
        self.tied = dict(
            getattr(hf_model, "all_tied_weights_keys", None) or getattr(hf_model, "_tied_weights_keys", None) or {}
        )

    def source(self, names: list[str]) -> str | None:
        """The model name (of ``names``, one tensor's) whose pieces the files hold; None: none."""
        found = next((n for n in names if n in self.layout), None)
        if found is None:  # a tied weight saved once, under its source's name
            found = next((self.tied[n] for n in names if n in self.tied and self.tied[n] in self.layout), None)
        return found

    def read(self, names: list[str], tensor: torch.Tensor) -> bool:
        """Read this rank's part of ``tensor`` (named ``names``); False when the files lack it."""
        found = self.source(names)
        if found is None:
            return False
        for local, shape, offset in _local_boxes(tensor):
            _read_into(local, shape, offset, self.layout[found], self.files)
        tensor._is_hf_initialized = True  # type: ignore[attr-defined]  # transformers' own mark: skip in initialize_weights
        return True

    def close(self) -> None:
        for handle in self.handles.values():
            handle.close()


def load_pretrained_weights(hf_model: nn.Module, folder: str | os.PathLike, device: torch.device | str) -> list[str]:
    """Fill ``hf_model`` (a transformers model, sharded or not, on the meta device or not) from the
    safetensors files in ``folder``: each rank reads only its own shards. Returns the model's keys
    the files do not hold (initialised as transformers initialises missing keys).

    Example::

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
        load_pretrained_weights(model, folder, "cpu")
    """
    checkpoint = _Checkpoint(hf_model, folder)
    materialize_meta(hf_model, device)
    missing: list[str] = []
    try:
        with torch.no_grad():
            for names, tensor in _tensors(hf_model):
                if not checkpoint.read(names, tensor):
                    missing.extend(names)
    finally:
        checkpoint.close()
    init = getattr(hf_model, "initialize_weights", None)
    if callable(init):  # non-persistent buffers (rotary inv_freq) and missing keys, as from_pretrained does
        init()
    return missing


# -- a model cut into pipeline stages: the buffers before the cut, each stage's parameters after ---
def missing_parameters(hf_model: nn.Module, folder: str | os.PathLike) -> list[str]:
    """The names of ``hf_model``'s parameters the files in ``folder`` do not hold (a tied weight
    saved under its source's name is held)."""
    checkpoint = _Checkpoint(hf_model, folder)
    checkpoint.close()
    names: dict[int, list[str]] = {}
    for name, value in hf_model.named_parameters(remove_duplicate=False):
        names.setdefault(id(value), []).append(name)
    return [n for group in names.values() if checkpoint.source(group) is None for n in group]


def load_pretrained_buffers(hf_model: nn.Module, folder: str | os.PathLike, device: torch.device | str) -> None:
    """Storage on ``device`` and values for ``hf_model``'s buffers only, its parameters left on the
    meta device (a pipeline reads them stage by stage after the cut: :func:`load_stage_weights`).
    Persistent buffers are read from the files; the rest (rotary ``inv_freq``) are initialised by
    the model's ``initialize_weights``, as transformers' ``from_pretrained`` does, which leaves
    meta parameters as they are (an init on the meta device computes nothing). Buffers are small:
    every rank holds them whole, and a pipeline's trace copies them into each decoder layer
    (:mod:`kiln.models.hf_stages`) before the cut."""
    checkpoint = _Checkpoint(hf_model, folder)
    buffers: set[int] = set()
    made: dict[int, torch.Tensor] = {}  # a buffer several modules hold stays one
    for module in hf_model.modules():
        for name, value in module._buffers.items():
            if value is not None and value.is_meta:
                module._buffers[name] = made.setdefault(id(value), torch.empty_like(value, device=device))
        buffers.update(id(b) for b in module._buffers.values() if b is not None)
    try:
        with torch.no_grad():
            for names, tensor in _tensors(hf_model):
                if id(tensor) in buffers:
                    checkpoint.read(names, tensor)
    finally:
        checkpoint.close()
    init = getattr(hf_model, "initialize_weights", None)
    if callable(init):
        init()


def load_stage_weights(
    hf_model: nn.Module, folder: str | os.PathLike, device: torch.device | str, stage: nn.Module, prefix: str
) -> int:
    """Storage on ``device`` for the meta tensors of ``stage`` (a pipeline stage cut from a model
    that holds ``hf_model`` at ``prefix``, with its names; sharded by the stage's tensor parallel
    and FSDP steps or not) and this rank's part of each, read from the files in ``folder``: a
    pipeline rank reads the weights of its own stage(s) only. A weight two stages hold (tied
    embeddings: the first stage's embedding, the last stage's head) is read by each. Returns the
    number of tensors read; a stage tensor the files do not hold raises a ``KeyError``."""
    # materialize_meta replaces the meta tensors with new ones: they are found again by name
    meta = {name for names, tensor in _tensors(stage) if tensor.is_meta for name in names}
    if not meta:
        return 0
    checkpoint = _Checkpoint(hf_model, folder)
    materialize_meta(stage, device)
    read = 0
    try:
        with torch.no_grad():
            for names, tensor in _tensors(stage):
                if not meta.intersection(names):
                    continue
                own = [n.removeprefix(prefix) for n in names if n.startswith(prefix)]
                if not checkpoint.read(own, tensor):
                    raise KeyError(
                        f"pipeline stage tensor {names[0]!r} is not in the safetensors files of {folder}; "
                        "load the model with HuggingFaceModel.from_pretrained(..., meta_init=False)"
                    )
                read += 1
    finally:
        checkpoint.close()
    return read


def meta_model(auto_class: Any, folder: Path, dtype: torch.dtype | str | None, kwargs: dict[str, Any]) -> nn.Module:
    """The transformers model of ``folder`` built on the meta device as ``from_pretrained`` builds
    it (its config, the dtype it resolves, ``kwargs`` to the config or the model), without weights."""
    import transformers

    config, unused = transformers.AutoConfig.from_pretrained(str(folder), return_unused_kwargs=True, **kwargs)
    resolved = resolve_dtype(config, dtype, folder)
    config.dtype = resolved  # as from_pretrained records it (the config an export writes says so)
    with torch.device("meta"):
        model = auto_class.from_config(config, dtype=resolved, **unused)
    # from_config marks every module initialised; the weights come later, and what the files do
    # not hold (rotary inv_freq) is initialised after them, so the marks go
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
    return model
