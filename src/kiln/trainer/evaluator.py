"""Named evaluation sets (Composer's ``Evaluator``): a loader with its own metrics and interval.

``Trainer(eval_dataloader=...)`` takes a plain loader (logged as ``eval/<metric>``, as always), one
:class:`Evaluator`, or a list of them, each logged as ``eval/<label>/<metric>`` and evaluated at
its own interval. :func:`as_evaluators` turns any of these into the list the Trainer keeps, and
:func:`due_evaluators` says which of them run at an event.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kiln.core.event import Event
from kiln.core.time import Time
from kiln.trainer.options import EvalOptions, _interval, _positive_int

__all__ = ["Evaluator", "as_evaluators", "due_evaluators", "evaluates_on"]


@dataclass
class Evaluator:
    """One evaluation set: its loader, the metrics computed on it and when it runs.

    Its results are logged (and put in ``state.metrics``) as ``eval/<label>/<metric>``, with
    ``eval/<label>/loss`` always among them, so ``save_best="eval/val/Accuracy"`` and
    ``EarlyStopper("val/Accuracy")`` watch one set. The label ``"eval"`` (Composer's default set)
    keeps a plain eval loader's keys, ``eval/<metric>``. Every rank runs the same number of forwards
    on each set, as for a plain eval loader (see :mod:`kiln.trainer.evaluation`).

    Args:
        label: the set's name in metric keys (``"val"``, ``"test"``); unique among the Trainer's sets.
        dataloader: its batches (a DataLoader with the default sampler is sharded over the
            data-parallel ranks, as the Trainer shards ``eval_dataloader``).
        metrics: what to compute besides the loss: ``None`` for the model's
            (``model.get_metrics(is_train=False)``, or the Trainer's ``eval_metrics=``), names of
            those (``["Accuracy"]``), or torchmetrics objects (a dict by name, or a list named by
            their class); objects are copied, so two sets never share a metric's state.
        interval: when it runs during ``fit()``: a Time (``"1ep"``, ``"50ba"``, ``"0.5dur"``),
            int epochs or ``fn(state, event) -> bool``; ``None`` is the Trainer's ``eval_interval``.
        subset_num_batches: evaluate the first N batches only (``None``: the Trainer's
            ``eval_subset_num_batches``).

    Example::

        trainer = kiln.Trainer(model, train_dataloader=train_dl, max_duration="10ep",
                               eval_dataloader=[kiln.Evaluator("val", val_dl, interval="100ba"),
                                                kiln.Evaluator("test", test_dl, metrics=["Accuracy"])])
        # logs eval/val/loss, eval/val/Accuracy every 100 batches; eval/test/... every epoch
    """

    label: str
    dataloader: Iterable
    metrics: str | Sequence[Any] | Mapping[str, Any] | None = None
    interval: int | str | Time | Callable[[Any, Event], bool] | None = None
    subset_num_batches: int | None = None
    prefix: str = field(default="", init=False, repr=False)
    """What its metric keys start with: ``eval/<label>`` (``eval`` for a plain eval loader)."""
    schedule: EvalOptions | None = field(default=None, init=False, repr=False)
    """Its own interval, checked; ``None``: the Trainer's."""
    named: bool = field(default=True, init=False, repr=False)
    """False for a plain eval loader: the model's metric objects themselves, as before Evaluators."""

    def __post_init__(self) -> None:
        label = self.label
        if not isinstance(label, str) or not label or label.startswith("/") or label.endswith("/"):
            raise ValueError(
                f"Evaluator label={label!r} must be a non-empty string without a leading or trailing '/'; "
                "it names the set in the metric keys (eval/<label>/<metric>)"
            )
        if self.dataloader is None:
            raise ValueError(f"Evaluator {label!r}: dataloader=None; give the loader of the evaluation set")
        _positive_int(f"Evaluator {label!r} subset_num_batches", self.subset_num_batches, none=True, extra=", or None")
        if self.interval is not None:
            self.schedule = EvalOptions(_interval(f"Evaluator {label!r} interval", self.interval))
        _check_metrics(label, self.metrics)
        # "eval" is the default set's label (Composer's): its keys are a plain eval loader's, eval/<metric>
        self.prefix = "eval" if label == "eval" else f"eval/{label}"


def _check_metrics(label: str, metrics: Any) -> None:
    if metrics is None:
        return  # the model's: nothing to import (torchmetrics is slow to import)
    from torchmetrics import Metric

    def fail() -> None:
        raise ValueError(
            f"Evaluator {label!r} metrics={metrics!r}: expected None (the model's metrics), names of the "
            "model's metrics (['Accuracy']), a dict of name -> torchmetrics.Metric or a list of Metrics"
        )

    if isinstance(metrics, (str, Metric)):
        return
    if isinstance(metrics, Mapping):
        if not all(isinstance(k, str) and isinstance(m, Metric) for k, m in metrics.items()):
            fail()
    elif not isinstance(metrics, Sequence) or not all(isinstance(m, (str, Metric)) for m in metrics):
        fail()


def chosen_metrics(label: str, selection: Any, available: Mapping[str, Any]) -> dict[str, Any]:
    """The metrics an Evaluator asked for: ``available`` (the model's), some of them by name, or
    copies of its own Metric objects."""
    if selection is None:
        return {name: metric.clone() for name, metric in available.items()}
    if isinstance(selection, Mapping):
        return {name: metric.clone() for name, metric in selection.items()}
    items = [selection] if not isinstance(selection, Sequence) or isinstance(selection, str) else selection
    chosen: dict[str, Any] = {}
    for item in items:
        if isinstance(item, str):
            if item not in available:
                raise ValueError(
                    f"Evaluator {label!r} asks for metric {item!r}, which the model does not have "
                    f"(it has {sorted(available) or 'none'}); pass a torchmetrics object instead, or fix the name"
                )
            chosen[item] = available[item].clone()
        else:
            chosen[type(item).__name__] = item.clone()
    return chosen


def as_evaluators(eval_dataloader: Any, shard: Callable[[Any], Any], label: str = "eval") -> list[Evaluator]:
    """The Trainer's evaluation sets from ``eval_dataloader=``: a plain loader is one set whose keys
    are ``<label>/<metric>`` (``eval/...``, unchanged); Evaluators keep their own. Loaders go
    through ``shard`` (sharding them over the data-parallel ranks); the user's Evaluators are copied."""
    if eval_dataloader is None:
        return []
    if isinstance(eval_dataloader, Evaluator):
        given = [eval_dataloader]
    elif (
        isinstance(eval_dataloader, (list, tuple))
        and eval_dataloader
        and any(isinstance(e, Evaluator) for e in eval_dataloader)
    ):
        if not all(isinstance(e, Evaluator) for e in eval_dataloader):
            raise TypeError(
                "eval_dataloader= mixes kiln.Evaluators with other items; wrap each loader in "
                "kiln.Evaluator(label, loader), or pass one plain loader"
            )
        given = list(eval_dataloader)
    else:  # a plain loader (a list of batches too)
        plain = Evaluator("eval", eval_dataloader)
        plain.dataloader, plain.prefix, plain.named = shard(eval_dataloader), label, False
        return [plain]
    labels = [e.label for e in given]
    duplicates = sorted({name for name in labels if labels.count(name) > 1})
    if duplicates:
        raise ValueError(f"eval_dataloader= has several Evaluators labelled {duplicates}; labels must be unique")
    copies = []
    for evaluator in given:
        copy = dataclasses.replace(evaluator, dataloader=shard(evaluator.dataloader))
        copies.append(copy)
    return copies


def evaluates_on(evaluators: Sequence[Evaluator], default: EvalOptions, event: Event) -> bool:
    """Whether any set can be due at ``event`` (so the loop need not ask every batch)."""
    return any((e.schedule or default).evaluates_on(event) for e in evaluators)


def due_evaluators(evaluators: Sequence[Evaluator], default: EvalOptions, state: Any, event: Event) -> list[Evaluator]:
    """The sets due at ``event``. The Trainer's ``eval_interval`` is asked once for all the sets that
    follow it: a callable interval may count its calls (the config layer's does)."""
    default_due: bool | None = None
    due = []
    for evaluator in evaluators:
        if evaluator.schedule is not None:
            if evaluator.schedule.eval_due(state, event):
                due.append(evaluator)
            continue
        if default_due is None:
            default_due = default.eval_due(state, event)
        if default_due:
            due.append(evaluator)
    return due
