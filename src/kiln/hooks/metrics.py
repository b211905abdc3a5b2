"""The accumulating metrics Colossal-AI's hooks keep in ``trainer.states['metrics'][mode]``.

Each iteration adds to a tensor on the device of the values it gets (no host synchronisation,
a microsecond of Python); reading the accumulated value, once per epoch, hands this rank's totals
to torchmetrics' ``SumMetric``, whose ``compute()`` sums them over every rank. The metrics are not
updated through torchmetrics every iteration because its ``update()`` costs 10-20 us of Python per
call, a fifth of a small model's step. The sum is taken on ``kiln.context().device``: gloo syncs
CPU tensors, NCCL only GPU ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torchmetrics import SumMetric

from kiln.launch.context import context

__all__ = ["HookMetric", "LossMetric", "AccuracyMetric", "LearningRateMetric", "ThroughputMetric"]


class _RankSum:
    """Numbers summed over every rank with torchmetrics: one ``SumMetric`` per number."""

    def __init__(self, count: int) -> None:
        # nan checks off: they cost a host sync, and a NaN loss should show as NaN
        self.metrics = [SumMetric(nan_strategy="disable") for _ in range(count)]

    def __call__(self, *values: torch.Tensor | float) -> list[torch.Tensor]:
        """Each of ``values`` (this rank's) summed over all ranks, as float32 tensors on the context's
        device; a collective: every rank calls it, in the same order."""
        device = context().device
        totals = []
        for metric, value in zip(self.metrics, values):
            metric.to(device)  # a no-op once there; the hook may have been made before launch
            metric.reset()
            metric.update(value.to(device) if isinstance(value, torch.Tensor) else value)
            totals.append(metric.compute())
        return totals


class HookMetric:
    """A metric a hook updates every iteration: ``reset``, ``update``, ``get_last_step_value``,
    ``get_accumulated_value`` and ``is_better(a, b)``."""

    higher_is_better = False

    def reset(self) -> None: ...

    def get_last_step_value(self) -> float:
        raise NotImplementedError

    def get_accumulated_value(self) -> float:
        raise NotImplementedError

    def is_better(self, a: float, b: float) -> bool:
        return a > b if self.higher_is_better else a < b


class LossMetric(HookMetric):
    """Mean loss over the epoch's iterations, averaged across ranks."""

    def __init__(self) -> None:
        self._totals = _RankSum(2)
        self.reset()

    def reset(self) -> None:
        self._sum: torch.Tensor | None = None
        self._count = 0
        self._last: torch.Tensor | None = None

    def update(self, loss: torch.Tensor) -> None:
        loss = loss.detach().float()
        self._last = loss
        self._sum = loss.clone() if self._sum is None else self._sum + loss
        self._count += 1

    def get_last_step_value(self) -> float:
        return float(self._last) if self._last is not None else float("nan")

    def get_accumulated_value(self) -> float:
        # every rank takes part in the sum, also one that saw no iteration (its totals are 0)
        loss_sum, count = self._totals(self._sum if self._sum is not None else 0.0, float(self._count))
        return float(loss_sum / count) if count else float("nan")


class AccuracyMetric(HookMetric):
    """Accuracy over the epoch, across ranks.

    ``accuracy_func`` is either a torchmetrics metric (``kiln.metrics.Accuracy()``: called per
    iteration, which updates its state; read with ``compute()``, which syncs ranks), or a callable
    returning the number of correct predictions (Colossal-AI's ``Accuracy``), summed here.
    """

    higher_is_better = True

    def __init__(self, accuracy_func: Callable[..., Any]) -> None:
        self.accuracy_func: Any = accuracy_func  # a function, or a torchmetrics Metric (reset, to, compute)
        self._torchmetric = hasattr(accuracy_func, "compute") and hasattr(accuracy_func, "reset")
        self._device: torch.device | None = None  # where the torchmetrics metric's state lives
        self._totals = _RankSum(2)
        self.reset()

    def reset(self) -> None:
        self._correct: torch.Tensor | float = 0.0
        self._total = 0
        self._last: Any = float("nan")
        if self._torchmetric:
            self.accuracy_func.reset()

    def update(self, output: torch.Tensor, label: torch.Tensor) -> None:
        if self._torchmetric and output.device != self._device:
            # the metric's state must sit with the outputs (on the GPU under NCCL): its
            # compute() syncs the state with a collective on the state's device
            self.accuracy_func.to(output.device)
            self._device = output.device
        result = self.accuracy_func(output.detach(), label.detach())
        if self._torchmetric:
            self._last = result  # the batch's accuracy; its state is accumulated inside the metric
        else:
            self._correct = self._correct + result.detach().float()
            self._total += label.shape[0]
            self._last = (result, label.shape[0])

    def get_last_step_value(self) -> float:
        if self._torchmetric:
            return float(self._last)
        correct, total = self._last
        return float(correct) / total

    def get_accumulated_value(self) -> float:
        if self._torchmetric:
            return float(self.accuracy_func.compute())
        correct, total = self._totals(self._correct, float(self._total))
        return float(correct / total) if total else float("nan")


class LearningRateMetric(HookMetric):
    """The current learning rate (no accumulation)."""

    def __init__(self, initial_lr: float = 0.0) -> None:
        self.lr = initial_lr

    def update(self, lr: float) -> None:
        self.lr = float(lr)

    def get_last_step_value(self) -> float:
        return self.lr

    def get_accumulated_value(self) -> float:
        return self.lr


class ThroughputMetric(HookMetric):
    """Samples per second over the epoch, summed across ranks."""

    higher_is_better = True

    def __init__(self) -> None:
        self._samples_all_ranks = _RankSum(1)
        self.reset()

    def reset(self) -> None:
        self._samples = 0
        self._seconds = 0.0
        self._last = 0.0

    def update(self, samples: int, seconds: float) -> None:
        self._samples += samples
        self._seconds += seconds
        self._last = samples / seconds if seconds > 0 else 0.0

    def get_last_step_value(self) -> float:
        return self._last

    def get_accumulated_value(self) -> float:
        # every rank takes part in the sum, also one whose own time is 0
        (samples,) = self._samples_all_ranks(float(self._samples))
        return float(samples) / self._seconds if self._seconds > 0 else 0.0
