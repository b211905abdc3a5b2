"""`kiln.Model`: Composer's ComposerModel interface for models that own their loss and metrics."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["Model"]


class Model(nn.Module):
    """A module that knows how to run a batch, compute its loss and update its metrics.

    Override ``forward(batch)`` and ``loss(outputs, batch)``; optionally ``eval_forward``,
    ``get_metrics`` and ``update_metric``. A plain ``nn.Module`` with ``criterion=`` works too:
    then a batch is ``(inputs, targets)``.

    Example::

        class Net(kiln.Model):
            def __init__(self):
                super().__init__()
                self.net = nn.Linear(64, 10)
            def forward(self, batch):
                x, _ = batch
                return self.net(x)
            def loss(self, outputs, batch):
                return F.cross_entropy(outputs, batch[1])
            def get_metrics(self, is_train=False):
                return {"Accuracy": torchmetrics.Accuracy(task="multiclass", num_classes=10)}
    """

    def forward(self, batch: Any) -> Any:  # noqa: D102
        raise NotImplementedError(f"{type(self).__name__} must implement forward(batch)")

    def loss(self, outputs: Any, batch: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement loss(outputs, batch)")

    def eval_forward(self, batch: Any, outputs: Any | None = None) -> Any:
        """Outputs for evaluation; defaults to ``forward`` (reusing ``outputs`` when given)."""
        return outputs if outputs is not None else self(batch)

    def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
        """torchmetrics Metric objects by name; empty by default."""
        return {}

    def update_metric(self, batch: Any, outputs: Any, metric: Any) -> None:
        """Update one metric with a batch; defaults to ``metric.update(outputs, batch[1])``."""
        metric.update(outputs, batch[1])
