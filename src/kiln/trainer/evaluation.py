"""The evaluation and prediction loops: eval forward, loss and metrics, synchronised across ranks.

Every rank runs the same number of forward calls. Under FSDP (zero2/zero3/fsdp), tensor and
pipeline parallelism each forward is a collective, and the evaluation shards of
:class:`kiln.launch.data.ShardSampler` differ by up to one batch; a rank that ran out of batches
would leave the others waiting in the next forward until the process-group timeout. So:

* the number of batches is agreed before the loop: the longest data-parallel shard's, computed
  from the sampler on every rank without communication for a loader kiln sharded (else one
  all-reduce of ``len(loader)`` per call; a loader without ``len`` agrees batch by batch);
* a rank whose shard is shorter runs padding forwards on a repeat of its first batch (or of the
  dataset's first samples when it has none): forward, loss and ``eval_forward`` run as for a real
  batch, but no event fires and the outputs feed no metric, loss or prediction;
* under a pipeline, whose traced shapes are fixed, a short last batch is padded with repeated rows
  to the loader's batch size and the outputs are cut back to its real rows.

Metrics therefore equal a one-process evaluation of the same weights on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import torch

from kiln.core.batch import num_samples, split_batch
from kiln.core.event import Event
from kiln.core.model import Model
from kiln.launch.data import ShardSampler
from kiln.trainer.evaluator import Evaluator, chosen_metrics, due_evaluators
from kiln.trainer.loss_mean import LossMean

__all__ = ["evaluate", "evaluate_sets", "evaluate_due", "fresh_metrics", "predict", "even_batches"]


class Trainer(Protocol):
    """What evaluation reads of the :class:`kiln.Trainer` it runs for (a protocol, so that this file,
    which ``trainer.py`` imports, does not import it back)."""

    state: Any
    engine: Any
    events: Any
    logger: Any
    options: Any
    progress: Any
    evaluators: list[Evaluator]
    eval_metrics: Any
    loss_fn: Any

    def to_device(self, batch: Any) -> Any: ...
    def forward(self, batch: Any) -> Any: ...


def fresh_metrics(trainer: Trainer, label: str, evaluator: Evaluator | None = None) -> dict[str, Any]:
    """The metric objects for ``label``, created once per label and reset before each evaluation.
    A named :class:`~kiln.trainer.evaluator.Evaluator` gets its own copies of the metrics it chose."""
    state = trainer.state
    metrics = state.eval_metrics.get(label)
    if metrics is None:
        model = state.model
        if isinstance(model, Model):
            metrics = dict(model.get_metrics(is_train=False))
        else:
            metrics = {name: m.clone() for name, m in (trainer.eval_metrics or {}).items()}
        if evaluator is not None and evaluator.named:  # a named set: copies, never shared
            metrics = chosen_metrics(evaluator.label, evaluator.metrics, metrics)
        metrics = {name: m.to(state.device) for name, m in metrics.items()}
        metrics["loss"] = LossMean(state.device)  # float64 sums; no torchmetrics import for the loss
        state.eval_metrics[label] = metrics
    for metric in metrics.values():
        metric.reset()
    return metrics


_END = object()  # what next() gives for an exhausted loader


def _data_parallel(trainer: Trainer) -> tuple[int, int]:
    engine = trainer.engine
    return engine.data_parallel_rank, engine.data_parallel_size


def _agreed_num_batches(trainer: Trainer, loader: Any) -> int | None:
    """Batches every rank runs: the longest shard's. ``None``: agree batch by batch (no ``len``)."""
    sampler = getattr(loader, "sampler", None)
    batch_size = getattr(loader, "batch_size", None)
    if isinstance(sampler, ShardSampler) and batch_size:
        longest = sampler.shard_length(0)  # known on every rank: no communication
        return longest // batch_size if loader.drop_last else math.ceil(longest / batch_size)
    try:
        local = len(loader)
    except TypeError:
        return None
    import torch.distributed as dist

    count = torch.tensor(local, device=trainer.engine.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)  # once per evaluation, not per batch
    return int(count.item())


def _any_rank_has(trainer: Trainer, has_batch: bool) -> bool:
    import torch.distributed as dist

    flag = torch.tensor(int(has_batch), device=trainer.engine.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _dataset_batch(loader: Any) -> Any:
    """A batch of the dataset's first samples, for a rank whose shard is empty."""
    # Any: whatever the loader holds; one that is missing or not map-style raises TypeError, caught below
    dataset: Any = getattr(loader, "dataset", None)
    collate: Any = getattr(loader, "collate_fn", None)
    try:
        size = min(getattr(loader, "batch_size", None) or 1, len(dataset))
        return collate([dataset[i] for i in range(size)])
    except TypeError:
        raise ValueError(
            f"this rank's evaluation shard of {type(loader).__name__} is empty, and kiln cannot build a "
            "padding batch from it (it needs a DataLoader over a map-style dataset); give every "
            "data-parallel rank at least one batch"
        ) from None


def even_batches(trainer: Trainer, loader: Any, limit: int | None = None) -> Iterator[tuple[Any, bool]]:
    """``(batch, is_real)``: this rank's batches of ``loader``, then padding batches (``is_real``
    False) until it has as many as the rank with the most (at most ``limit``). Batches are on the
    device. With one data-parallel rank (every rank reads the same batches) nothing is padded."""
    _, dp_size = _data_parallel(trainer)
    if dp_size == 1:
        for index, batch in enumerate(loader):
            if limit is not None and index >= limit:
                return
            yield trainer.to_device(batch), True
        return
    total = _agreed_num_batches(trainer, loader)
    batches, first, index = iter(loader), None, 0
    while (total is None or index < total) and (limit is None or index < limit):
        batch = next(batches, _END) if batches is not None else _END
        if batch is _END:
            batches = None
        if total is None and not _any_rank_has(trainer, batch is not _END):
            return  # a loader without len: every rank has run out
        if batch is not _END:
            batch = trainer.to_device(batch)
            if first is None:
                first = batch
            yield batch, True
        else:
            if first is None:
                first = trainer.to_device(_dataset_batch(loader))
            yield first, False
        index += 1


def _fixed_rows(trainer: Trainer, loader: Any) -> int | None:
    """The row count every forward must have: a pipeline's traced shapes are fixed."""
    if not trainer.engine.strategy.fixed_batch_rows:
        return None
    return getattr(loader, "batch_size", None)


def _repeat_rows(data: Any, rows: int, size: int) -> Any:
    if isinstance(data, torch.Tensor):
        return data[torch.arange(size, device=data.device) % rows] if data.dim() and data.shape[0] == rows else data
    if isinstance(data, (list, tuple)):
        return type(data)(_repeat_rows(item, rows, size) for item in data)
    if isinstance(data, Mapping):
        return type(data)(  # type: ignore[call-arg]  # its own mapping class, which takes a dict
            {k: _repeat_rows(v, rows, size) for k, v in data.items()}
        )
    return data


def _take_rows(data: Any, rows: int, size: int) -> Any:
    if isinstance(data, torch.Tensor):
        return data[:rows] if data.dim() and data.shape[0] == size else data
    if isinstance(data, (list, tuple)):
        return type(data)(_take_rows(item, rows, size) for item in data)
    if isinstance(data, Mapping):
        return type(data)(  # type: ignore[call-arg]  # its own mapping class, which takes a dict
            {k: _take_rows(v, rows, size) for k, v in data.items()}
        )
    return data


def _forward(
    trainer: Trainer, batch: Any, fixed_rows: int | None, with_loss: bool = True
) -> tuple[Any, torch.Tensor | None, Any]:
    """``(outputs, loss, eval_outputs)`` of one batch, padded with repeated rows to ``fixed_rows``
    for the forward and cut back to the batch's own rows after it. No loss for prediction, whose
    batches may hold no targets."""
    rows = num_samples(batch) if fixed_rows else 0
    fixed = fixed_rows or 0
    padded = 0 < rows < fixed
    inputs = _repeat_rows(batch, rows, fixed) if padded else batch
    outputs = trainer.forward(inputs)
    model = trainer.state.model
    eval_outputs = model.eval_forward(inputs, outputs) if isinstance(model, Model) else outputs
    if padded:
        outputs, eval_outputs = _take_rows(outputs, rows, fixed), _take_rows(eval_outputs, rows, fixed)
    return outputs, trainer.loss_fn(outputs, batch) if with_loss else None, eval_outputs


def evaluate_sets(
    trainer: Trainer, evaluators: list[Evaluator], subset_num_batches: int | None = None
) -> dict[str, float]:
    """Evaluate each set in turn (each with its own metrics); returns all their results.
    ``subset_num_batches`` overrides the sets' own, which override the Trainer's."""
    default, progress = trainer.options.evaluation.eval_subset_num_batches, trainer.progress
    results: dict[str, float] = {}
    for evaluator in evaluators:
        subset = subset_num_batches or evaluator.subset_num_batches or default
        progress.eval_start(trainer.state, evaluator.prefix, evaluator.dataloader, subset)  # lines in a log file
        result = evaluate(trainer, evaluator.dataloader, evaluator.prefix, subset, evaluator)
        progress.eval_end(evaluator.prefix, result)
        results.update(result)
    return results


def evaluate_due(trainer: Trainer, event: Event) -> None:
    """Evaluate the Trainer's sets that are due at ``event`` (each at its own interval)."""
    due = due_evaluators(trainer.evaluators, trainer.options.evaluation, trainer.state, event)
    if due:
        evaluate_sets(trainer, due)


@torch.no_grad()
def evaluate(
    trainer: Trainer,
    dataloader: Any,
    label: str = "eval",
    subset_num_batches: int | None = None,
    evaluator: Evaluator | None = None,
) -> dict[str, float]:
    """Run ``dataloader`` through the model in eval mode; returns ``{"<label>/loss": ..., "<label>/<Metric>": ...}``.

    Metric states are summed across ranks in ``compute()`` (torchmetrics', and the loss's
    :class:`~kiln.trainer.loss_mean.LossMean`), so every rank gets the
    same values, equal to a single-process evaluation of the same data. Padding forwards (see the
    module docstring) fire no event and update no metric. ``evaluator``: the named set being run,
    whose metrics are used.
    """
    state, engine, events = trainer.state, trainer.engine, trainer.events
    metrics = fresh_metrics(trainer, label, evaluator)
    loss_metric = metrics["loss"]
    user_metrics = {k: m for k, m in metrics.items() if k != "loss"}
    model = state.model
    kiln_model = model if isinstance(model, Model) else None
    was_training = engine.model.training
    engine.eval()
    state.eval_dataloader = dataloader
    fixed_rows = _fixed_rows(trainer, dataloader)
    events.run(Event.EVAL_START)
    for batch, is_real in even_batches(trainer, dataloader, subset_num_batches):
        if not is_real:
            _forward(trainer, batch, fixed_rows)  # the collectives the other ranks' forwards wait for
            continue
        state.batch = batch
        events.run(Event.EVAL_BATCH_START)
        events.run(Event.EVAL_BEFORE_FORWARD)
        batch = state.batch
        _, loss, outputs = _forward(trainer, batch, fixed_rows)
        state.outputs, state.eval_loss = outputs, loss
        events.run(Event.EVAL_AFTER_FORWARD)
        assert loss is not None  # _forward computes the loss unless told not to
        loss_metric.update(loss.detach(), weight=num_samples(batch))
        for metric in user_metrics.values():
            if kiln_model is not None:
                kiln_model.update_metric(batch, state.outputs, metric)
            else:
                metric.update(state.outputs, batch[1])
        events.run(Event.EVAL_BATCH_END)
    results = {f"{label}/{name}": float(metric.compute()) for name, metric in metrics.items()}
    state.metrics.update(results)
    events.run(Event.EVAL_END)
    trainer.logger.log_metrics(results, step=state.timestamp.batch.value)
    engine.train(was_training)
    return results


@torch.no_grad()
def predict(trainer: Trainer, dataloader: Any, gather: bool = False) -> list[Any] | None:
    """The model's outputs (``eval_forward``'s for a kiln.Model) for ``dataloader``, in eval mode.

    ``dataloader`` is sharded over the data-parallel ranks as for evaluation. ``gather=False``:
    each rank returns its own shard's outputs, batch by batch. ``gather=True``: rank 0 returns
    every output in dataset order, batched as one process batches the loader (on the CPU when
    there is more than one rank), and the other ranks return ``None``; nothing but rank 0 holds
    the whole. Padding forwards (see the module docstring) add no output.
    """
    engine = trainer.engine
    was_training = engine.model.training
    engine.eval()
    fixed_rows = _fixed_rows(trainer, dataloader)
    outputs = []
    try:
        for batch, is_real in even_batches(trainer, dataloader):
            out = _forward(trainer, batch, fixed_rows, with_loss=False)[2]  # padding too: the others wait on it
            if is_real:
                outputs.append(out)
    finally:
        engine.train(was_training)
    if not gather or trainer.state.world_size == 1:
        return outputs
    return _gather_in_order(trainer, dataloader, outputs)


def _gather_in_order(trainer: Trainer, loader: Any, outputs: list[Any]) -> list[Any] | None:
    """Rank 0: every rank's outputs in dataset order, re-batched by the loader's batch size."""
    import torch.distributed as dist

    dp_rank, dp_size = _data_parallel(trainer)
    rank = trainer.state.rank
    outputs = [_to_cpu(out) for out in outputs]
    if dp_size == 1:  # every rank computed every output: rank 0's are the whole
        return outputs if rank == 0 else None
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, ShardSampler):
        raise ValueError(
            f"predict(gather=True) over {dp_size} data-parallel ranks needs to know which sample "
            f"each rank read, but the loader's sampler is {type(sampler).__name__}; pass a DataLoader "
            "with the default sequential sampler (kiln shards it), or gather=False"
        )
    # Ranks of one tensor-parallel group or pipeline hold the same outputs: the lowest rank of each
    # data-parallel rank sends them, the others send nothing.
    coords: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(coords, dp_rank)
    sends = coords.index(dp_rank) == rank
    shard = (sampler.rank, _cat_rows(outputs)) if sends and outputs else None
    parts: list[Any] | None = [None] * len(coords) if rank == 0 else None
    dist.gather_object(shard, parts, dst=0)
    if rank != 0:
        return None
    assert parts is not None  # rank 0 gathers
    shards = [part for part in parts if part is not None]
    if not shards:
        return []
    # Sample i of the dataset is row i // W of shard i % W (see ShardSampler).
    position = torch.cat([torch.arange(num_samples(out)) * sampler.num_replicas + r for r, out in shards])
    merged = _cat_rows([out for _, out in shards])
    order = torch.argsort(position)
    return split_batch(_index_rows(merged, order), getattr(loader, "batch_size", None) or len(order))


def _to_cpu(data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return data.detach().cpu()
    if isinstance(data, (list, tuple)):
        return type(data)(_to_cpu(item) for item in data)
    if isinstance(data, Mapping):
        return type(data)(  # type: ignore[call-arg]  # its own mapping class, which takes a dict
            {k: _to_cpu(v) for k, v in data.items()}
        )
    return data


def _cat_rows(parts: list[Any]) -> Any:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, (list, tuple)):
        return type(first)(_cat_rows([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, Mapping):
        return type(first)(  # type: ignore[call-arg]  # its own mapping class, which takes a dict
            {k: _cat_rows([p[k] for p in parts]) for k in first}
        )
    raise TypeError(
        f"predict(gather=True) puts outputs in dataset order row by row, and cannot do that with "
        f"a {type(first).__name__}; return tensors (or tuples/dicts of tensors) with a leading batch "
        "dimension, or use gather=False"
    )


def _index_rows(data: Any, index: torch.Tensor) -> Any:
    if isinstance(data, torch.Tensor):
        return data[index]
    if isinstance(data, (list, tuple)):
        return type(data)(_index_rows(item, index) for item in data)
    return type(data)({k: _index_rows(v, index) for k, v in data.items()})
