"""Publish Hugging Face folders while a run trains: :class:`HFExport`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kiln.core.callback import Callback
from kiln.core.state import State
from kiln.core.time import Time, TimeUnit
from kiln.models.hf_folder import DEFAULT_MAX_SHARD_SIZE, TensorSource, parse_size, write_hf_folder
from kiln.models.huggingface import HuggingFaceModel

__all__ = ["HFExport"]


class HFExport(Callback):
    """Write the model as a Hugging Face folder every ``interval`` batches and at the end of ``fit``.

    Each export is its own folder ``folder/ba<N>`` (the batch it was taken after), written under a
    temporary name and renamed when complete, so a reader (a serving job polling the folder) sees
    whole folders only. Sharded weights (FSDP, tensor parallel) are gathered one tensor at a time,
    each by an all-gather every rank joins, and written by rank 0 straight into its safetensors file
    (:func:`kiln.models.hf_folder.write_hf_folder`): no process holds the whole model. The config is
    the transformers model's own; ``from_pretrained(folder/"ba100")`` loads the weights the run had then.

    Args:
        folder: where the exports go (created when missing).
        interval: every how many batches (``"100ba"`` or an int); the end of ``fit`` always exports.
        max_shard_size: the largest safetensors file (``"5GB"``, ``"500MB"``); several files get an index.
        dtype: cast floating weights (``torch.bfloat16``, ``"bfloat16"``); None: as trained.

    Example::

        trainer = kiln.Trainer(kiln.models.HuggingFaceModel.from_pretrained("llama"), ...,
                               callbacks=[kiln.callbacks.HFExport("exports", interval="1000ba")])
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        interval: str | int = "1000ba",
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        dtype: str | torch.dtype | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.every = _batches(interval)
        parse_size(max_shard_size)  # refused here, not after the first interval's training
        self.max_shard_size = max_shard_size
        self.dtype = getattr(torch, dtype.replace("torch.", "")) if isinstance(dtype, str) else dtype
        self.exported: list[Path] = []
        self._last_batch: int | None = None

    def batch_end(self, state: State, logger: Any) -> None:
        batch = int(state.timestamp.batch.value)
        if batch % self.every == 0:
            self.export(state, batch)

    def fit_end(self, state: State, logger: Any) -> None:
        batch = int(state.timestamp.batch.value)
        if batch != self._last_batch:
            self.export(state, batch)

    def export(self, state: State, batch: int) -> Path:
        """Write ``folder/ba<batch>`` now (every rank calls it: sharded weights are gathered)."""
        hf = next((m for m in state.model.modules() if isinstance(m, HuggingFaceModel)), None)
        if hf is None:
            raise TypeError(
                f"HFExport exports a kiln.models.HuggingFaceModel; the model is a {type(state.model).__name__} "
                "(a pipeline's stages keep no transformers model: export its checkpoint with kiln checkpoint export --hf)"
            )
        sources = [_source(name, value, self.dtype) for name, value in hf.model.state_dict().items()]
        out = self.folder / f"ba{batch}"
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if rank == 0:
            hf_config: Any = hf.model.config  # a transformers PretrainedConfig
            config = json.loads(hf_config.to_json_string(use_diff=False))
            config.setdefault("architectures", [type(hf.model).__name__])
            write_hf_folder(out, config, sources, max_shard_size=self.max_shard_size)
        else:  # the same gathers, in the writer's order, without writing
            for source in sources:
                source.load()
        self.exported.append(out)
        self._last_batch = batch
        return out


def _source(name: str, value: torch.Tensor, dtype: torch.dtype | None) -> TensorSource:
    target = dtype if dtype is not None and value.is_floating_point() else value.dtype

    def load() -> torch.Tensor:
        full = value.full_tensor() if hasattr(value, "full_tensor") else value  # a DTensor: one all-gather
        return full.detach().to("cpu")

    return TensorSource(name, tuple(value.shape), target, load)


def _batches(interval: str | int) -> int:
    if isinstance(interval, int):
        every = interval
    else:
        time = Time.from_timestring(interval)
        if time.unit != TimeUnit.BATCH:
            raise ValueError(f"HFExport interval={interval!r} must count batches, e.g. '100ba' (or an int)")
        every = int(time.value)
    if every < 1:
        raise ValueError(f"HFExport interval={interval!r} must be at least 1 batch")
    return every
