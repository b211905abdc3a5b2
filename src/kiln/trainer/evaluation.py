"""The evaluation loop: eval forward, loss and metrics, synchronised across ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kiln.core.event import Event
from kiln.core.model import Model
from kiln.trainer.batching import num_samples

if TYPE_CHECKING:
    from kiln.trainer.trainer import Trainer

__all__ = ["evaluate", "fresh_metrics"]


def fresh_metrics(trainer: Trainer, label: str) -> dict[str, Any]:
    """The metric objects for ``label``, created once per label and reset before each evaluation."""
    state = trainer.state
    metrics = state.eval_metrics.get(label)
    if metrics is None:
        from torchmetrics import MeanMetric  # imported here: torchmetrics is slow to import

        model = state.model
        if isinstance(model, Model):
            metrics = dict(model.get_metrics(is_train=False))
        else:
            metrics = {name: m.clone() for name, m in (trainer.eval_metrics or {}).items()}
        metrics = {name: m.to(state.device) for name, m in metrics.items()}
        metrics["loss"] = MeanMetric().to(state.device)
        state.eval_metrics[label] = metrics
    for metric in metrics.values():
        metric.reset()
    return metrics


@torch.no_grad()
def evaluate(trainer: Trainer, dataloader: Any, label: str = "eval", subset_num_batches: int | None = None) -> dict[str, float]:
    """Run ``dataloader`` through the model in eval mode; returns ``{"<label>/loss": ..., "<label>/<Metric>": ...}``.

    Metric states are summed across ranks by torchmetrics in ``compute()``, so every rank gets the
    same values, equal to a single-process evaluation of the same data.
    """
    state, engine, events = trainer.state, trainer.engine, trainer.events
    metrics = fresh_metrics(trainer, label)
    loss_metric = metrics["loss"]
    user_metrics = {k: m for k, m in metrics.items() if k != "loss"}
    model = state.model
    is_kiln_model = isinstance(model, Model)
    was_training = engine.model.training
    engine.eval()
    state.eval_dataloader = dataloader
    events.run(Event.EVAL_START)
    for index, batch in enumerate(dataloader):
        if subset_num_batches is not None and index >= subset_num_batches:
            break
        batch = trainer.to_device(batch)
        state.batch = batch
        events.run(Event.EVAL_BATCH_START)
        events.run(Event.EVAL_BEFORE_FORWARD)
        batch = state.batch
        outputs = trainer.forward(batch)
        loss = trainer.loss_fn(outputs, batch)
        if is_kiln_model:
            outputs = model.eval_forward(batch, outputs)
        state.outputs, state.eval_loss = outputs, loss
        events.run(Event.EVAL_AFTER_FORWARD)
        loss_metric.update(loss.detach().float(), weight=num_samples(batch))
        for metric in user_metrics.values():
            if is_kiln_model:
                model.update_metric(batch, state.outputs, metric)
            else:
                metric.update(state.outputs, batch[1])
        events.run(Event.EVAL_BATCH_END)
    results = {f"{label}/{name}": float(metric.compute()) for name, metric in metrics.items()}
    state.metrics.update(results)
    events.run(Event.EVAL_END)
    trainer.logger.log_metrics(results, step=state.timestamp.batch.value)
    engine.train(was_training)
    return results
