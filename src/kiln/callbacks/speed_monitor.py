"""`SpeedMonitor`: training throughput over a sliding window of batches, and MFU."""

from __future__ import annotations

from collections import deque
from typing import Any, NamedTuple

import torch
from torch.utils.flop_counter import FlopCounterMode

from kiln.callbacks.device_flops import describe_peak, peak_flops_per_sec
from kiln.core.batch import num_samples
from kiln.core.callback import Callback
from kiln.core.state import State
from kiln.core.time import Timestamp

__all__ = ["SpeedMonitor", "TrainingFlopCounter"]


class _Point(NamedTuple):
    wct: float
    batch: int
    sample: int
    token: int
    flops: float


def _compute_dtype(precision: Any, model: Any = None) -> torch.dtype:
    """The dtype matmuls run in under a kiln precision (or precision name); float32 when unknown.
    A model with torchao float8 linear layers runs its matmuls in float8."""
    if model is not None and any(type(m).__name__ == "Float8Linear" for m in model.modules()):
        return getattr(torch, "float8_e4m3fn", torch.float32)
    if isinstance(precision, str):
        from kiln.precision import get_precision  # a layer below; imported only for a bare name

        precision = get_precision(precision)
    for attr in ("autocast_dtype", "param_dtype"):
        dtype = getattr(precision, attr, None)
        if isinstance(dtype, torch.dtype):
            return dtype
    return torch.float32


def _local(value: Any) -> Any:
    """DTensors replaced by this rank's shard, in a nested structure (others left as they are)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_map_only

    return tree_map_only(DTensor, lambda t: t.to_local(), value)


class TrainingFlopCounter(FlopCounterMode):
    """``torch.utils.flop_counter.FlopCounterMode`` for one training step on this rank: the FLOPs of
    the forward and the backward, in the model-FLOPs sense of MFU.

    Two differences from torch's counter:

    * an op on DTensors (tensor parallel) counts the matmul this rank runs on its shards, not the
      one the global shapes describe (which every rank of the group would count again);
    * ops the backward runs with grad mode on are the forward that activation checkpointing
      recomputes; they go to ``recomputed_flops``, not the total: MFU counts the model's FLOPs
      (forward and backward once), not the hardware's.

    Counting observes the ops and runs each one as it would run anyway (same kernels, same RNG,
    same gradients); its cost is a Python call per op. ``torch.compile`` does not compile frames
    under a dispatch mode, so compiled code runs eagerly while counting.

    Example::

        with TrainingFlopCounter() as counter:
            loss_fn(model(x), y).backward()
        counter.get_total_flops()
    """

    def __init__(self) -> None:
        super().__init__(display=False)
        self.recomputed_flops = 0

    def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
        # torch's hook for one op (FlopCounterMode._count_flops, called by its dispatch mode).
        if torch._C._current_graph_task_id() != -1 and torch.is_grad_enabled():
            # the backward runs its nodes with grad mode off (no create_graph): with it on, a
            # checkpointed region is running its forward again
            if func_packet in self.flop_registry:
                self.recomputed_flops += self.flop_registry[func_packet](
                    *_local(args), **_local(kwargs), out_val=_local(out)
                )
            return out
        if any(type(t).__name__ == "DTensor" for t in (*args, out) if isinstance(t, torch.Tensor)):
            super()._count_flops(func_packet, _local(out), _local(args), _local(kwargs))
            return out
        return super()._count_flops(func_packet, out, args, kwargs)


class SpeedMonitor(Callback):
    """Log batches, samples and tokens per second over the last ``window_size`` batches, and MFU.

    The rates divide the counts of the window by ``state.timestamp.total_wct``, the wall-clock time
    the loop spent in training batches, so time spent in evaluation and checkpointing does not
    lower them. They are logged at every ``BATCH_END`` of a ``fit``: ``throughput/batches_per_sec``;
    ``throughput/device/samples_per_sec`` and ``throughput/device/tokens_per_sec`` (when batches
    have tokens) for this rank, from the timestamp's per-rank counts; and
    ``throughput/samples_per_sec``, ``throughput/tokens_per_sec`` for the whole run (the device
    rates times the world size: data-parallel ranks take batches of the same size in lockstep).

    FLOPs: a model's own ``flops_per_batch`` (an int, or a callable taking the batch and giving this
    rank's FLOPs for forward and backward) wins. Without one, the callback counts the first
    training batch's forward and backward on this rank with :class:`TrainingFlopCounter` (torch's
    ``FlopCounterMode``: matmuls, convolutions and attention, exactly, from the shapes) while it
    trains, and scales the count by each later batch's samples. Counting the real step, rather than
    a copy, adds no forward, step or random draw to the run, so a run with the monitor trains the
    same numbers as one without; under ``torch.compile`` that first batch runs uncompiled. The count
    is kept in the callback's state, so a resumed run does not count again. ``count_flops=False``
    turns counting off.

    With FLOPs the callback logs ``throughput/device/flops_per_sec`` (and
    ``throughput/flops_per_sec``, times the world size) and, when the device's peak is known (see
    :mod:`kiln.callbacks.device_flops`) or given, ``throughput/mfu``; when it is not, it says so
    once at the start of ``fit`` (``peak_note`` keeps the line). MFU is this rank's own (no
    collective); data-parallel ranks run in lockstep, so rank 0's is the run's.

    Args:
        window_size: how many batches the rates average over.
        peak_flops_per_sec: the device's peak FLOP/s, for devices the table does not know (CPUs).
        count_flops: count the FLOPs of the first batch when the model gives no ``flops_per_batch``.

    Example::

        trainer = kiln.Trainer(model, ..., callbacks=[kiln.callbacks.SpeedMonitor(window_size=50)])
    """

    def __init__(
        self, window_size: int = 100, peak_flops_per_sec: float | None = None, count_flops: bool = True
    ) -> None:
        if not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f"SpeedMonitor window_size must be a positive int, got {window_size!r}")
        if peak_flops_per_sec is not None and not peak_flops_per_sec > 0:
            raise ValueError(f"SpeedMonitor peak_flops_per_sec must be positive, got {peak_flops_per_sec!r}")
        self.window_size = window_size
        self.peak_flops_per_sec = peak_flops_per_sec
        self.count_flops = count_flops
        # window_size + 1 points bound window_size batches.
        self._points: deque[_Point] = deque(maxlen=window_size + 1)
        self._flops = 0.0
        self._peak: float | None = peak_flops_per_sec
        self.peak_note = ""
        # counted: this rank's forward+backward FLOPs per sample (None: not counted yet)
        self.flops_per_sample: float | None = None
        self._counter: TrainingFlopCounter | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"flops_per_sample": self.flops_per_sample}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.flops_per_sample = state.get("flops_per_sample")

    def fit_start(self, state: State, logger: Any) -> None:
        # Start a fresh window at each fit (a resumed run's clock includes the previous process).
        self._points.clear()
        self._flops = 0.0
        self._points.append(self._point(state.timestamp))
        self._stop_counting()  # a fit that raised mid-count left its counter open
        dtype = _compute_dtype(state.precision, state.model)
        self._peak = self.peak_flops_per_sec or peak_flops_per_sec(state.device, dtype)
        if self.peak_flops_per_sec:
            self.peak_note = f"peak {self.peak_flops_per_sec / 1e12:g} TFLOP/s: given"
        else:
            self.peak_note = describe_peak(state.device, dtype)
            if self._peak is None:
                from kiln.launch.logging import get_dist_logger  # a layer below

                get_dist_logger().info(f"SpeedMonitor: no MFU; {self.peak_note}", ranks=[0])

    def _wants_count(self, state: State) -> bool:
        return (
            self.count_flops
            and self.flops_per_sample is None
            and getattr(state.model, "flops_per_batch", None) is None
            and len(self._points) > 0  # inside a fit
        )

    def before_train_batch(self, state: State, logger: Any) -> None:
        if self._counter is None and self._wants_count(state):
            self._counter = TrainingFlopCounter()
            self._counter.__enter__()

    def after_train_batch(self, state: State, logger: Any) -> None:
        # the batch's forwards and backwards are done; the optimizer step is not counted
        counter = self._stop_counting()
        if counter is not None:
            self.flops_per_sample = counter.get_total_flops() / max(num_samples(state.batch), 1)

    def _stop_counting(self) -> TrainingFlopCounter | None:
        counter, self._counter = self._counter, None
        if counter is not None:
            counter.__exit__(None, None, None)
        return counter

    def close(self, state: State, logger: Any) -> None:
        self._stop_counting()

    def _point(self, timestamp: Timestamp) -> _Point:
        return _Point(
            timestamp.total_wct, timestamp.batch.value, timestamp.sample.value, timestamp.token.value, self._flops
        )

    def _batch_flops(self, state: State) -> float | None:
        flops_per_batch = getattr(state.model, "flops_per_batch", None)
        if flops_per_batch is not None:
            return float(flops_per_batch(state.batch) if callable(flops_per_batch) else flops_per_batch)
        if self.flops_per_sample is not None and state.batch is not None:
            return self.flops_per_sample * num_samples(state.batch)
        return None

    def batch_end(self, state: State, logger: Any) -> None:
        flops = self._batch_flops(state)
        if flops is not None:
            self._flops += flops
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
        if flops is not None:
            flops_per_sec = (last.flops - first.flops) / elapsed
            metrics["throughput/device/flops_per_sec"] = flops_per_sec
            metrics["throughput/flops_per_sec"] = flops_per_sec * world_size
            if self._peak:
                metrics["throughput/mfu"] = flops_per_sec / self._peak
        logger.log_metrics(metrics)
