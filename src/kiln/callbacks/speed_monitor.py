"""`SpeedMonitor`: training throughput over a sliding window of batches, and MFU."""

from __future__ import annotations

from collections import deque
from typing import Any, NamedTuple

import torch

from kiln.callbacks.device_flops import peak_flops_per_sec
from kiln.core.callback import Callback
from kiln.core.state import State
from kiln.core.time import Timestamp

__all__ = ["SpeedMonitor"]


class _Point(NamedTuple):
    wct: float
    batch: int
    sample: int
    token: int
    flops: float


def _compute_dtype(precision: Any) -> torch.dtype:
    """The dtype matmuls run in under a kiln precision (or precision name); float32 when unknown."""
    if isinstance(precision, str):
        from kiln.precision import get_precision  # a layer below; imported only for a bare name

        precision = get_precision(precision)
    for attr in ("autocast_dtype", "param_dtype"):
        dtype = getattr(precision, attr, None)
        if isinstance(dtype, torch.dtype):
            return dtype
    return torch.float32


class SpeedMonitor(Callback):
    """Log batches, samples and tokens per second over the last ``window_size`` batches.

    The rates divide the counts of the window by ``state.timestamp.total_wct``, the wall-clock time
    the loop spent in training batches, so time spent in evaluation and checkpointing does not
    lower them. They are logged at every ``BATCH_END`` of a ``fit``: ``throughput/batches_per_sec``;
    ``throughput/device/samples_per_sec`` and ``throughput/device/tokens_per_sec`` (when batches
    have tokens) for this rank, from the timestamp's per-rank counts; and
    ``throughput/samples_per_sec``, ``throughput/tokens_per_sec`` for the whole run (the device
    rates times the world size: data-parallel ranks take batches of the same size in lockstep).

    MFU: when the model has ``flops_per_batch`` (an int, or a callable taking the batch and giving
    this rank's FLOPs for forward and backward) the callback also logs
    ``throughput/device/flops_per_sec`` (and ``throughput/flops_per_sec``, times the world size) and, when the device's peak is known (see
    :mod:`kiln.callbacks.device_flops`; never for CPUs) or given, ``throughput/mfu``. MFU is this
    rank's own (no collective); data-parallel ranks run in lockstep, so rank 0's is the run's.

    Args:
        window_size: how many batches the rates average over.
        peak_flops_per_sec: the device's peak FLOP/s, for devices the table does not know.

    Example::

        trainer = kiln.Trainer(model, ..., callbacks=[kiln.callbacks.SpeedMonitor(window_size=50)])
    """

    def __init__(self, window_size: int = 100, peak_flops_per_sec: float | None = None) -> None:
        if not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f"SpeedMonitor window_size must be a positive int, got {window_size!r}")
        self.window_size = window_size
        self.peak_flops_per_sec = peak_flops_per_sec
        # window_size + 1 points bound window_size batches.
        self._points: deque[_Point] = deque(maxlen=window_size + 1)
        self._flops = 0.0
        self._peak: float | None = peak_flops_per_sec

    def fit_start(self, state: State, logger: Any) -> None:
        # Start a fresh window at each fit (a resumed run's clock includes the previous process).
        self._points.clear()
        self._flops = 0.0
        self._points.append(self._point(state.timestamp))
        self._peak = self.peak_flops_per_sec or peak_flops_per_sec(state.device, _compute_dtype(state.precision))

    def _point(self, timestamp: Timestamp) -> _Point:
        return _Point(
            timestamp.total_wct, timestamp.batch.value, timestamp.sample.value, timestamp.token.value, self._flops
        )

    def batch_end(self, state: State, logger: Any) -> None:
        flops_per_batch = getattr(state.model, "flops_per_batch", None)
        if flops_per_batch is not None:
            flops = flops_per_batch(state.batch) if callable(flops_per_batch) else flops_per_batch
            self._flops += float(flops)
        self._points.append(self._point(state.timestamp))
        if len(self._points) < 2:
            return  # no FIT_START seen: the first point only opens the window
        first, last = self._points[0], self._points[-1]
        elapsed = last.wct - first.wct
        if elapsed <= 0:
            return
        world_size = max(1, state.world_size)
        # The Trainer counts samples and tokens of the whole run (every rank's batch): the run's
        # rates are the counts' rates, the device rates divide by the world size.
        metrics = {"throughput/batches_per_sec": (last.batch - first.batch) / elapsed}
        run = {"samples_per_sec": (last.sample - first.sample) / elapsed}
        if last.token > first.token:
            run["tokens_per_sec"] = (last.token - first.token) / elapsed
        for name, rate in run.items():
            metrics[f"throughput/{name}"] = rate
            metrics[f"throughput/device/{name}"] = rate / world_size
        if flops_per_batch is not None:
            flops_per_sec = (last.flops - first.flops) / elapsed
            metrics["throughput/device/flops_per_sec"] = flops_per_sec
            metrics["throughput/flops_per_sec"] = flops_per_sec * world_size
            if self._peak:
                metrics["throughput/mfu"] = flops_per_sec / self._peak
        logger.log_metrics(metrics)
