"""The Logger: the one object callbacks and the loop log through; it fans out to destinations."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from kiln.loggers.destination import LoggerDestination

__all__ = ["Logger"]


class Logger:
    """Sends metrics, hyperparameters and text to every destination that writes on this rank.

    This is the ``logger`` passed to ``run_event(event, state, logger)``. Metric values may be
    Python numbers, NumPy scalars or one-element tensors; tensors are turned into Python numbers
    here and only here, and only when at least one destination will write them. That is the one
    host sync logging costs: keep a loss on the device and hand it over as a tensor rather than
    calling ``.item()`` in the training step.

    Args:
        destinations: Destinations (or a single one) to write to.
        rank: This process's global rank. ``None`` asks ``torch.distributed`` (0 when no
            process group is initialised).
        state: The Trainer's ``kiln.State``; when set, ``log_metrics`` without a ``step`` uses
            the current batch count (``state.timestamp.batch.value``).

    Attributes:
        latest: The last value written on this rank of each metric, as a Python number (what
            the progress bar shows, without reading the device again).

    Example::

        logger = Logger([ConsoleLogger(), FileLogger("runs/metrics.jsonl")])
        logger.log_hyperparameters({"lr": 0.01, "batch_size": 32})
        logger.log_metrics({"train/loss": loss, "train/lr": 0.01}, step=12)   # loss: a tensor
        logger.close()
    """

    def __init__(
        self,
        destinations: Iterable[LoggerDestination] | LoggerDestination = (),
        rank: int | None = None,
        state: Any = None,
    ) -> None:
        if isinstance(destinations, LoggerDestination):
            destinations = [destinations]
        self.destinations: list[LoggerDestination] = list(destinations)
        for destination in self.destinations:
            if not isinstance(destination, LoggerDestination):
                raise TypeError(
                    f"Logger destinations must be kiln.loggers.LoggerDestination instances, got "
                    f"{type(destination).__name__}; subclass LoggerDestination to write elsewhere"
                )
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = rank
        self.state = state
        self.latest: dict[str, Any] = {}

    def _writing(self) -> list[LoggerDestination]:
        """The destinations that write on this rank."""
        return [d for d in self.destinations if self.rank == 0 or not d.rank_zero_only]

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log scalar metrics at ``step`` (default: the state's batch count, if a state is set)."""
        destinations = self._writing()
        if not destinations or not metrics:
            return  # nothing converted: no host sync on ranks that do not write
        if step is None and self.state is not None:
            step = int(self.state.timestamp.batch.value)
        values = _metrics_to_python(metrics)
        self.latest.update(values)
        for destination in destinations:
            # A copy each, so a destination that edits its dict cannot change what the next sees.
            destination.log_metrics(dict(values), step)

    def log_hyperparameters(self, params: Mapping[str, Any]) -> None:
        """Log the run's configuration (nested dicts allowed)."""
        destinations = self._writing()
        if not destinations:
            return
        values = _params_to_python(params)
        for destination in destinations:
            destination.log_hyperparameters(dict(values))

    def log_text(self, text: str, step: int | None = None) -> None:
        """Log free text to the destinations that have a text channel."""
        for destination in self._writing():
            destination.log_text(text, step)

    def log_images(
        self, images: Any, name: str = "images", step: int | None = None, *, channels_last: bool = False
    ) -> None:
        """Log images under ``name`` to the destinations that show images (TensorBoard, W&B, MLflow).

        ``images``: a tensor or NumPy array shaped ``(N, C, H, W)``, ``(C, H, W)`` or ``(H, W)``
        (``(N, H, W, C)`` with ``channels_last=True``) or a list of them; floats in [0, 1] or
        integers in [0, 255]. They are copied to the host once, only when a destination writes.
        ``step`` defaults to the state's batch count, as for ``log_metrics``.
        """
        destinations = self._writing()
        if not destinations:
            return
        from kiln.loggers.images import as_uint8_nhwc

        if step is None and self.state is not None:
            step = int(self.state.timestamp.batch.value)
        array = as_uint8_nhwc(images, channels_last)
        for destination in destinations:
            destination.log_images(array, name, step)

    def flush(self) -> None:
        for destination in self._writing():
            destination.flush()

    def close(self) -> None:
        """Close every destination (for Engine-style use; the Trainer closes them as callbacks)."""
        for destination in self.destinations:
            destination.close()


def _metrics_to_python(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Metric values as Python numbers, with one device-to-host copy per device and dtype."""
    values = dict(metrics)
    groups: dict[tuple[torch.device, torch.dtype], list[str]] = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"metric {key!r} must be a scalar, got a tensor of shape {tuple(value.shape)}; "
                    f"log a reduction such as value.mean()"
                )
            groups.setdefault((value.device, value.dtype), []).append(key)
        elif not isinstance(value, (int, float)) and hasattr(value, "item"):
            values[key] = value.item()  # a NumPy scalar: not JSON serialisable as it is
    for keys in groups.values():
        # Stacking the tensors of one device and dtype and copying once costs a single sync,
        # where an .item() per metric would stall the host once per metric.
        stacked = torch.stack([metrics[k].detach().reshape(()) for k in keys])
        values.update(zip(keys, stacked.tolist()))
    return values


def _params_to_python(params: Mapping[str, Any]) -> dict[str, Any]:
    """Hyperparameters with tensors and NumPy values turned into Python values, recursively."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, Mapping):
            out[key] = _params_to_python(value)
        elif isinstance(value, torch.Tensor) or (
            not isinstance(value, (int, float, str, bool)) and hasattr(value, "tolist")
        ):
            out[key] = value.tolist()  # a 0-dim tensor or NumPy scalar gives a Python number
        else:
            out[key] = value
    return out
