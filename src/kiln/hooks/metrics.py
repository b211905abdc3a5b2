"""The accumulating metrics Colossal-AI's hooks keep in ``trainer.states['metrics'][mode]``.

Values accumulate on the device and are summed across ranks (one all-reduce) only when read,
once per epoch, so the per-iteration path has no host synchronisation.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["HookMetric", "LossMetric", "AccuracyMetric", "LearningRateMetric", "ThroughputMetric"]


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = t.clone()
        dist.all_reduce(t)
    return t


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
        if self._sum is None:
            return float("nan")
        total = _all_reduce_sum(torch.stack([self._sum.cpu(), torch.tensor(float(self._count))]))
        return float(total[0] / total[1])


class AccuracyMetric(HookMetric):
    """Accuracy over the epoch, across ranks.

    ``accuracy_func`` is either a torchmetrics metric (``kiln.metrics.Accuracy()``: called per
    iteration, which updates its state; read with ``compute()``, which syncs ranks), or a callable
    returning the number of correct predictions (Colossal-AI's ``Accuracy``), summed here.
    """

    higher_is_better = True

    def __init__(self, accuracy_func: Callable[..., Any]) -> None:
        self.accuracy_func = accuracy_func
        self._torchmetric = hasattr(accuracy_func, "compute") and hasattr(accuracy_func, "reset")
        self.reset()

    def reset(self) -> None:
        self._correct: torch.Tensor | float = 0.0
        self._total = 0
        self._last: Any = float("nan")
        if self._torchmetric:
            self.accuracy_func.reset()

    def update(self, output: torch.Tensor, label: torch.Tensor) -> None:
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
        total = _all_reduce_sum(torch.stack([torch.as_tensor(self._correct, dtype=torch.float32).cpu(),
                                             torch.tensor(float(self._total))]))
        return float(total[0] / total[1]) if total[1] else float("nan")


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
        if self._seconds <= 0:
            return 0.0
        samples = _all_reduce_sum(torch.tensor(float(self._samples)))
        return float(samples) / self._seconds
