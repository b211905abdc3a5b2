"""Metrics on torchmetrics, synchronised across ranks when their value is computed.

Every metric here is a ``torchmetrics.Metric``. ``update()`` only accumulates this rank's state
(no communication, no host sync); ``compute()`` gathers the state of every rank of the default
``torch.distributed`` process group first, so the value is the metric over the whole data set.
That makes ``compute()`` a collective: every rank must call it, in the same order (the Trainer
does this at ``EVAL_END``; :func:`sync_metrics` does it for a dict of metrics).

``Accuracy()`` with no arguments is the Colossal-AI form: top-1 accuracy inferred from logits
and integer targets. With ``task=``/``num_classes=`` every class here forwards to torchmetrics.

Example::

    acc = kiln.metrics.Accuracy()
    acc.update(torch.tensor([[2.0, 0.1], [0.3, 0.9]]), torch.tensor([0, 0]))
    acc.compute()   # tensor(0.5000)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
import torchmetrics
from torchmetrics import MeanMetric, Metric, MetricCollection, SumMetric

__all__ = [
    "Metric",
    "MetricCollection",
    "MeanMetric",
    "SumMetric",
    "Accuracy",
    "Precision",
    "Recall",
    "F1Score",
    "CrossEntropy",
    "sync_metrics",
]


def _infer_task(task: str | None, kwargs: Mapping[str, Any]) -> str | None:
    """The torchmetrics task implied by the arguments; None when none is implied."""
    if task is not None:
        return task
    if kwargs.get("num_labels") is not None:
        return "multilabel"
    if kwargs.get("num_classes") is not None:
        return "multiclass"
    return None


def _class_last(preds: torch.Tensor, target: torch.Tensor, name: str) -> torch.Tensor:
    """``preds`` with the class dimension last, given scores with one more dimension than ``target``.

    torch's losses put classes in dim 1 (N, C, ...); Colossal-AI's accuracy takes the last dim
    (N, ..., C). Both are accepted; for 2-D scores they are the same.
    """
    if preds.shape[:-1] == target.shape:
        return preds
    if preds.ndim >= 3 and preds.shape[:1] + preds.shape[2:] == target.shape:
        return preds.movedim(1, -1)
    raise ValueError(
        f"{name}: scores of shape {tuple(preds.shape)} do not fit targets of shape "
        f"{tuple(target.shape)}; expected (N, C) with (N,), or (N, ..., C) / (N, C, ...) with (N, ...)"
    )


class Accuracy(Metric):
    """Accuracy: the fraction of predictions that equal the target.

    ``Accuracy()`` infers the input form on each update: scores with one more dimension than the
    targets are multiclass (top-``top_k`` over the class dimension, last or dim 1); floats of the
    targets' shape are binary (probabilities thresholded at 0.5, or logits through a sigmoid when
    outside [0, 1], as torchmetrics does); integers of the targets' shape are labels.
    ``Accuracy(task=..., num_classes=...)`` (or just ``num_classes=``/``num_labels=``) returns the
    torchmetrics metric for that task instead, with all of its options.

    Args:
        task: ``"binary"``, ``"multiclass"`` or ``"multilabel"`` to use torchmetrics' metric.
        top_k: count a prediction correct when the target is among the ``top_k`` highest scores.
        ignore_index: a target value to leave out of the count (e.g. padding, -100).
        **kwargs: torchmetrics ``Metric`` options (``process_group``, ``dist_sync_on_step``, ...),
            or the task metric's options when a task is given or implied.

    Example::

        acc = kiln.metrics.Accuracy()
        acc(logits, labels)          # this batch's accuracy; also accumulated
        acc.compute()                # accuracy over everything seen, on every rank
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False
    correct: torch.Tensor
    total: torch.Tensor

    def __new__(cls, task: str | None = None, *args: Any, **kwargs: Any) -> Any:
        task = _infer_task(task, kwargs)
        if task is not None:  # torchmetrics' wrapper builds e.g. MulticlassAccuracy
            return torchmetrics.Accuracy(task, *args, **kwargs)  # type: ignore[arg-type]  # torchmetrics checks the name
        return super().__new__(cls)

    def __getnewargs__(self) -> tuple:
        # torchmetrics passes the metric's repr here for its own __new__; ours must get no task.
        return ()

    def __init__(
        self, task: str | None = None, *, top_k: int = 1, ignore_index: int | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        if not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"Accuracy top_k must be a positive int, got {top_k!r}")
        self.top_k = top_k
        self.ignore_index = ignore_index
        # Integer counts: exact, and summed (not averaged) across ranks by compute().
        self.add_state("correct", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("total", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        target = target.detach()
        preds = preds.detach()
        if preds.ndim == target.ndim + 1:
            scores = _class_last(preds, target, "Accuracy")
            if self.top_k == 1:
                hit = scores.argmax(dim=-1) == target
            else:
                hit = (scores.topk(self.top_k, dim=-1).indices == target.unsqueeze(-1)).any(dim=-1)
        elif preds.shape == target.shape:
            if preds.is_floating_point():
                # torchmetrics' rule; the range check costs a host sync, acceptable outside the step.
                if bool(((preds < 0) | (preds > 1)).any()):
                    preds = preds.sigmoid()
                preds = (preds > 0.5).to(target.dtype)
            hit = preds == target
        else:
            raise ValueError(
                f"Accuracy: predictions of shape {tuple(preds.shape)} do not fit targets of shape "
                f"{tuple(target.shape)}; pass scores (N, C) or labels/probabilities of shape (N,)"
            )
        if self.ignore_index is not None:
            keep = target != self.ignore_index
            hit = hit & keep
            self.total += keep.sum()
        else:
            self.total += target.numel()
        self.correct += hit.sum()

    def compute(self) -> torch.Tensor:
        # An empty metric gives 0 rather than NaN, as torchmetrics' classification metrics do.
        return self.correct.float() / self.total.clamp(min=1)


class _TaskMetric:
    """A torchmetrics task metric whose ``task`` is implied by ``num_classes``/``num_labels``."""

    _wrapped: ClassVar[Any]

    def __new__(cls, task: str | None = None, *args: Any, **kwargs: Any) -> Any:
        task = _infer_task(task, kwargs)
        if task is None:
            raise ValueError(
                f"{cls.__name__} needs to know the task: pass num_classes=N (multiclass), "
                f"num_labels=N (multilabel) or task='binary'"
            )
        return cls._wrapped(task, *args, **kwargs)


class Precision(_TaskMetric):
    """torchmetrics ``Precision``; ``Precision(num_classes=10)`` means the multiclass task."""

    _wrapped = torchmetrics.Precision


class Recall(_TaskMetric):
    """torchmetrics ``Recall``; ``Recall(num_classes=10)`` means the multiclass task."""

    _wrapped = torchmetrics.Recall


class F1Score(_TaskMetric):
    """torchmetrics ``F1Score``; ``F1Score(num_classes=10)`` means the multiclass task."""

    _wrapped = torchmetrics.F1Score


class CrossEntropy(Metric):
    """Mean cross-entropy of logits against class indices (or class probabilities) over all samples.

    Args:
        ignore_index: a target class to leave out, as in ``torch.nn.functional.cross_entropy``.
        **kwargs: torchmetrics ``Metric`` options.

    Example::

        ce = kiln.metrics.CrossEntropy()
        ce.update(logits, labels)
        ce.compute()   # equals F.cross_entropy over all batches seen, on all ranks
    """

    is_differentiable = True
    higher_is_better = False
    full_state_update = False
    sum_loss: torch.Tensor
    total: torch.Tensor

    def __init__(self, ignore_index: int = -100, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ignore_index = ignore_index
        self.add_state("sum_loss", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        if preds.ndim == target.ndim + 1 and not target.is_floating_point():
            # cross_entropy wants classes in dim 1; accept Colossal-AI's classes-last layout too.
            preds = _class_last(preds, target, "CrossEntropy").movedim(-1, 1)
            count = (target != self.ignore_index).sum()
        else:  # class probabilities of the scores' shape
            count = torch.tensor(preds.numel() // preds.shape[1], device=preds.device)
        loss = F.cross_entropy(preds.detach().float(), target, ignore_index=self.ignore_index, reduction="sum")
        self.sum_loss += loss.double()
        self.total += count

    def compute(self) -> torch.Tensor:
        return (self.sum_loss / self.total.clamp(min=1)).float()


def sync_metrics(metrics: Mapping[str, Metric] | Iterable[Metric], prefix: str = "") -> dict[str, Any]:
    """Compute every metric over all ranks and return ``{prefix + name: value}``.

    A collective: each metric's ``compute()`` all-gathers its state across the process group, so
    every rank must call this with the same metrics in the same order. Scalars come back as
    Python floats (one host transfer for all of them); other results stay tensors. Metrics given
    as a list are named by their class (``"Accuracy"``).

    Example::

        values = kiln.metrics.sync_metrics({"Accuracy": acc, "loss": mean_loss}, prefix="eval/")
        # {"eval/Accuracy": 0.93, "eval/loss": 0.21} on every rank
    """
    named = metrics.items() if isinstance(metrics, Mapping) else ((type(m).__name__, m) for m in metrics)
    values: dict[str, Any] = {}
    for name, metric in named:
        result = metric.compute()
        if isinstance(result, Mapping):  # a MetricCollection
            values.update({f"{prefix}{key}": value for key, value in result.items()})
        else:
            values[f"{prefix}{name}"] = result
    by_device: dict[torch.device, list[str]] = {}
    for key, value in values.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            by_device.setdefault(value.device, []).append(key)
    for device, keys in by_device.items():
        # One stacked copy to the host per device instead of an .item() per metric (MPS has no float64).
        dtype = torch.float32 if device.type == "mps" else torch.float64
        host = torch.stack([values[k].detach().to(dtype).reshape(()) for k in keys]).tolist()
        values.update(zip(keys, host))
    return values
