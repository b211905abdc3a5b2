"""The base class of every logger: where metrics and hyperparameters end up."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kiln.core.callback import Callback

if TYPE_CHECKING:
    import numpy as np

    from kiln.core.state import State

__all__ = ["LoggerDestination"]


class LoggerDestination(Callback):
    """A place metrics are written to: the console, a file, TensorBoard, W&B, MLflow.

    Destinations are not called directly by training code: the :class:`kiln.loggers.Logger`
    handed to every event (``run_event(event, state, logger)``) fans each call out to its
    destinations, converts tensors to Python numbers once, and skips destinations that should not
    write on this rank. Destinations are also Callbacks, so they see every event (they run last)
    and may keep resumable state (a run id) in ``state_dict``.

    Every method has a do-nothing default, so a destination overrides only what it supports.
    Writers (files, services) should be opened on the first write, not in ``__init__``: every rank
    builds its destinations, but with ``rank_zero_only`` only rank 0 ever writes, and opening a
    file or a remote run on every rank would leave empty files and runs behind.

    Args:
        rank_zero_only: Write only on rank 0 (the default). ``False`` makes every rank write,
            e.g. per-rank debugging output.

    Example::

        class PrintDestination(kiln.loggers.LoggerDestination):
            def log_metrics(self, metrics, step=None):
                print(step, metrics)

        trainer = kiln.Trainer(model, loggers=[PrintDestination()], ...)
    """

    # A class attribute as well, so a subclass that forgets super().__init__() still works.
    rank_zero_only: bool = True

    def __init__(self, *, rank_zero_only: bool = True) -> None:
        self.rank_zero_only = rank_zero_only

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Write numeric metrics (already Python numbers) recorded at ``step``."""

    def log_hyperparameters(self, params: dict[str, Any]) -> None:
        """Write the run's configuration (may be nested dicts)."""

    def log_text(self, text: str, step: int | None = None) -> None:
        """Write free text; destinations without a text channel ignore it."""

    def log_images(self, images: np.ndarray, name: str, step: int | None = None) -> None:
        """Write images: a ``(N, H, W, C)`` uint8 array (C is 1, 3 or 4), converted by the Logger.
        Destinations without an image channel (console, file) ignore them."""

    def flush(self) -> None:
        """Push buffered records to their file or service."""

    def close(self, state: State | None = None, logger: Any = None) -> None:
        """Flush and release files, writers and runs. Safe to call more than once."""
        self.flush()

    # Flushing at epoch and fit end bounds what a crash can lose without flushing every batch.
    def epoch_end(self, state: State, logger: Any) -> None:
        self.flush()

    def fit_end(self, state: State, logger: Any) -> None:
        self.flush()


def _flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts into dotted keys (``{"optim": {"lr": 1}}`` -> ``{"optim.lr": 1}``).

    For destinations whose hyperparameters are a flat key/value list (MLflow, TensorBoard text).
    """
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(_flatten_params(value, prefix=f"{name}."))
        else:
            flat[name] = value
    return flat
