"""A checkpoint's model as a Hugging Face folder: ``config.json`` + safetensors files (one
``model.safetensors``, or several and ``model.safetensors.index.json``).

``transformers.AutoModelFor...from_pretrained(OUT)`` loads what :func:`export_hf` writes, with the
weights the checkpoint holds. It reads any save type (sharded, deduped, merged folder or file) from
any world size through :func:`kiln.checkpoint.offline.load_full`, with no process group and no
model. The config comes from the checkpoint itself: a :class:`kiln.models.HuggingFaceModel` keeps
its model's class and config in its ``_extra_state`` entry; a checkpoint without one (saved from
the transformers model itself, or by a pipeline, whose stages drop that entry) needs ``config=``.
transformers is not needed to export.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kiln.checkpoint import layout
from kiln.checkpoint.checkpointing import verify_checkpoint
from kiln.checkpoint.errors import CheckpointError
from kiln.checkpoint.hf_export import dcp_model_entries, dcp_sources, read_dcp_key
from kiln.checkpoint.offline import _checkpoint, load_full, safetensors_weights
from kiln.checkpoint.storage import RemotePath, as_path
from kiln.models.hf_folder import DEFAULT_MAX_SHARD_SIZE, TensorSource, parse_size, write_hf_folder
from kiln.precision import DTYPES

__all__ = ["export_hf", "MissingConfigError", "CONFIG_FILE", "WEIGHTS_FILE"]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
_EXTRA_STATE = "_extra_state"
_WRAPPED = "model."  # the attribute a HuggingFaceModel holds its transformers model under


class MissingConfigError(CheckpointError):
    """The checkpoint holds no Hugging Face config and none was given: an input is missing, so
    ``kiln checkpoint export --hf`` exits 2 (a damaged checkpoint exits 1)."""


def export_hf(
    path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    config: Mapping[str, Any] | str | os.PathLike | Any | None = None,
    dtype: str | torch.dtype | None = None,
    tokenizer: Any = None,
    storage_options: Mapping[str, Any] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Any:
    """Write the model of checkpoint ``path`` as a Hugging Face folder ``out`` (which must not exist).

    A sharded checkpoint on the local disk is streamed: each tensor is read alone from the DCP
    shards and written into its safetensors file (:mod:`kiln.checkpoint.hf_export`), so the export
    holds one tensor at a time, not the model. The files are at most ``max_shard_size`` each
    (transformers' sizes: ``"5GB"``, ``"500MB"``, ``"20KB"``), with ``model.safetensors.index.json``
    when there are several; one file is ``model.safetensors``.

    On the local disk the folder is written under a temporary name and renamed when complete; on
    an object store (``out`` an fsspec URL) its files are uploaded with ``config.json`` last, which
    is what ``from_pretrained`` looks for first. Either way a failure leaves nothing behind.

    Args:
        path: a checkpoint folder or merged ``.pt`` file of any save type and world size.
        out: the folder to create: a local path or an fsspec URL (``s3://bucket/models/a``).
        config: the model's config when the checkpoint holds none (a dict, a ``config.json`` file
            or the folder holding it, or a transformers config object); overrides the checkpoint's.
        dtype: cast floating-point weights (``"bf16"``, ``"fp16"``, ``"fp32"``, ``"float64"``...);
            None keeps the checkpoint's.
        tokenizer: a tokenizer to save beside the model (its ``save_pretrained(out)``).
        storage_options: for URLs (``path`` and ``out``), the fsspec filesystem's options.
        max_shard_size: the largest file (an object store gets one ``model.safetensors``).

    Raises:
        CheckpointError: the checkpoint is unreadable, ``out`` exists, or the folder cannot be
            written; :class:`MissingConfigError` (one) when it holds no config and none was given.
            The message names the file and the fix.

    Example::

        kiln.checkpoint.export_hf("runs/a/last", "exported")
        model = transformers.AutoModelForCausalLM.from_pretrained("exported")
    """
    target = as_path(out, storage_options)
    if target.exists() or target.is_symlink():
        raise CheckpointError(target, "already exists", "choose a new folder for the export, or remove it first")
    cast = _dtype(dtype)
    source = _checkpoint(as_path(path, storage_options))
    if isinstance(target, Path) and isinstance(source, Path) and source.is_dir():
        manifest = verify_checkpoint(source)
        if manifest["save_type"] != "merged":  # DCP shards: streamed, one tensor at a time
            return _export_streaming(source, target, config, cast, tokenizer, max_shard_size)
    parse_size(max_shard_size)  # refused before the checkpoint is read
    _, tensors, _ = load_full(source, model_only=True)
    state = tensors["model"] or {}
    saved_prefix, saved = _saved_config(state)
    if config is not None:
        config_dict = _config_dict(config)
    elif saved is not None:
        config_dict = saved["config"]
    else:
        raise MissingConfigError(
            path,
            "holds no Hugging Face config (it was not saved from a kiln.models.HuggingFaceModel, or was "
            "saved by a pipeline, whose stages keep no config)",
            "pass the model's config: --config DIR (the folder with its config.json) or export_hf(..., config=...)",
        )
    prefix = _weights_prefix(state, saved_prefix)
    weights = safetensors_weights(state, prefix, cast)
    if not weights:
        raise CheckpointError(path, "holds no model weights", "export a checkpoint a Trainer or Engine saved")
    config_dict = dict(config_dict)
    if saved is not None and not config_dict.get("architectures"):
        config_dict["architectures"] = [saved["class"]]
    floating = [v.dtype for v in weights.values() if v.is_floating_point()]
    if floating:  # what from_pretrained(dtype="auto") builds the model in
        config_dict["dtype"] = str(floating[0]).replace("torch.", "")
    if isinstance(target, RemotePath):
        _upload(target, config_dict, weights, tokenizer)
        return target
    sources = [TensorSource(k, tuple(v.shape), v.dtype, _constant(v)) for k, v in weights.items()]
    _write_folder(target, config_dict, sources, tokenizer, max_shard_size)
    return target


def _constant(value: torch.Tensor) -> Any:
    return lambda: value


def _export_streaming(
    path: Path, target: Path, config: Any, cast: torch.dtype | None, tokenizer: Any, max_shard_size: int | str
) -> Path:
    """A sharded checkpoint's model into ``target`` without gathering it (:mod:`kiln.checkpoint.hf_export`)."""
    parse_size(max_shard_size)
    entries = dcp_model_entries(path)
    extra = [
        k for k in entries if k.endswith(_EXTRA_STATE) and not isinstance(getattr(entries[k], "size", None), torch.Size)
    ]
    saved_prefix, saved = _saved_config({k: read_dcp_key(path, "model." + k) for k in extra})
    if config is not None:
        config_dict = dict(_config_dict(config))
    elif saved is not None:
        config_dict = dict(saved["config"])
    else:
        raise MissingConfigError(
            path,
            "holds no Hugging Face config (it was not saved from a kiln.models.HuggingFaceModel, or was "
            "saved by a pipeline, whose stages keep no config)",
            "pass the model's config: --config DIR (the folder with its config.json) or export_hf(..., config=...)",
        )
    names = {k: None for k, v in entries.items() if hasattr(v, "size") and k not in extra}
    prefix = _weights_prefix({k: torch.empty(0) for k in names}, saved_prefix)
    sources = dcp_sources(path, prefix, cast)
    if not sources:
        raise CheckpointError(path, "holds no model weights", "export a checkpoint a Trainer or Engine saved")
    if saved is not None and not config_dict.get("architectures"):
        config_dict["architectures"] = [saved["class"]]
    _write_folder(target, config_dict, sources, tokenizer, max_shard_size)
    return target


def _write_folder(
    target: Path, config: dict[str, Any], sources: list[TensorSource], tokenizer: Any, max_shard_size: int | str
) -> None:
    try:
        write_hf_folder(
            target,
            config,
            sources,
            max_shard_size=max_shard_size,
            tokenizer=tokenizer,
            temporary_name=layout.temporary_name,
        )
    except OSError as exc:
        raise CheckpointError(
            target, f"could not be written ({type(exc).__name__}: {exc})", "check free space and permissions there"
        ) from None


def _saved_config(state: Mapping[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """``(prefix, extra state)`` of the HuggingFaceModel in ``state`` (``("", None)`` if none)."""
    from kiln.models.huggingface import EXTRA_STATE_FORMAT

    for key, value in state.items():
        if not key.endswith(_EXTRA_STATE) or not isinstance(value, (str, bytes)):
            continue
        try:
            saved = json.loads(value)
        except ValueError:
            continue
        if isinstance(saved, dict) and saved.get("format") == EXTRA_STATE_FORMAT:
            return key[: -len(_EXTRA_STATE)], saved
    return "", None


def _weights_prefix(state: Mapping[str, Any], saved_prefix: str) -> str:
    names = [k for k, v in state.items() if isinstance(v, torch.Tensor)]
    if names and all(k.startswith(saved_prefix + _WRAPPED) for k in names):
        return saved_prefix + _WRAPPED  # a HuggingFaceModel's weights, behind "model."
    return saved_prefix


def _config_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        file = Path(config)
        if file.is_dir():
            file = file / CONFIG_FILE
        try:
            loaded = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(
                file, f"is not a readable config.json ({type(exc).__name__}: {exc})", "pass the model's config.json"
            ) from None
        if not isinstance(loaded, dict):
            raise CheckpointError(file, "holds no JSON object", "pass the model's config.json")
        return loaded
    to_json = getattr(config, "to_json_string", None)
    if callable(to_json):  # a transformers PretrainedConfig
        return json.loads(to_json(use_diff=False))
    raise TypeError(f"config={config!r} must be a dict, a config.json file or folder, or a transformers config object")


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    value = DTYPES.get(dtype, getattr(torch, str(dtype), None))
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype={dtype!r} is not known; expected one of {', '.join(DTYPES)} or a torch dtype name")
    return value


def _upload(out: RemotePath, config: dict[str, Any], weights: dict[str, torch.Tensor], tokenizer: Any) -> None:
    """The folder on an object store: no rename there, so each file is one PUT (whole or absent)
    and ``config.json``, without which no loader treats the folder as a model, goes last."""
    import tempfile

    from safetensors.torch import save

    try:
        out.mkdir(parents=True, exist_ok=True)
        if tokenizer is not None:  # save_pretrained writes local files: upload them
            with tempfile.TemporaryDirectory() as local:
                tokenizer.save_pretrained(local)
                for file in sorted(Path(local).rglob("*")):
                    if file.is_file() and file.name != CONFIG_FILE:
                        (out / file.relative_to(local).as_posix()).write_bytes(file.read_bytes())
        (out / WEIGHTS_FILE).write_bytes(save(weights, metadata={"format": "pt"}))
        (out / CONFIG_FILE).write_bytes(_config_bytes(config))
    except BaseException as exc:  # nothing half uploaded stays behind, whatever stopped it
        try:
            out.rmtree()
        except Exception:  # the store is gone too: the error below says what happened first
            pass
        if isinstance(exc, Exception) and not isinstance(exc, CheckpointError):
            raise CheckpointError(
                out,
                f"could not be written ({type(exc).__name__}: {exc})",
                "check the URL, the credentials and write access to the bucket",
            ) from None
        raise


def _config_bytes(config: dict[str, Any]) -> bytes:
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
